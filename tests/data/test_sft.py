"""SFT batches (data/sft.py).

Proves: every row is its sample's template ids with labels = the next id on assistant tokens (content and closing
<|end|>) and IGNORE_INDEX (= trainer.loss.IGNORE_INDEX) elsewhere and on padding, inputs padded with pad_id; T is the
batch's longest row rounded up to pad_multiple, or seq_len with fixed_length; long samples are truncated to seq_len
and those whose prompt alone fills it are dropped, both counted; data ranks read disjoint samples, the same number
of batches each, steps of similar lengths; bucketing pads less than random batches (and the loader's running
padding share is measure_padding's); a restored loader yields exactly the batches an uninterrupted one would,
across epochs, and refuses a state saved over other samples; malformed JSONL lines and schema violations are
skipped, counted by reason and warned about once per reason; webdataset shards (written by the webdataset library),
a directory and a glob give the same samples as the JSONL file; split_samples is a seeded, disjoint split.
"""

import json
import random
import warnings

import pytest
import torch

from data.chat import ChatTemplate
from data.sft import IGNORE_INDEX, SFTLoader, load_samples, measure_padding, split_samples
from data.tokenizer import train_tokenizer
from tests.data.synthetic import _WORDS, write_text_corpus


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return ChatTemplate(train_tokenizer(write_text_corpus(tmp_path_factory.mktemp("corpus")), vocab_size=400))


def make_samples(n: int, seed: int = 0, max_words: int = 40) -> list[dict]:
    """Conversations of very different lengths; sample i's user turn starts with "#i", so rows are identifiable."""
    rng = random.Random(seed)
    words = lambda k: " ".join(rng.choice(_WORDS) for _ in range(k))  # noqa: E731
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"#{i} " + words(rng.randint(1, 8))},
                    {"role": "assistant", "content": words(rng.randint(1, max_words))}]
        if i % 3 == 0:
            messages = [{"role": "system", "content": words(3)}] + messages
        if i % 4 == 0:
            messages += [{"role": "tool", "content": words(2)}, {"role": "assistant", "content": words(5)}]
        out.append({"messages": messages, **({"effort": 1 + i % 100} if i % 2 else {})})
    return out


def _rows(batch):
    for x, y in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
        yield x, y


def _expected_row(template, sample, seq_len):
    ids, mask = template.encode(sample["messages"], sample.get("effort", 100))
    ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
    return ids[:-1], [i if m else IGNORE_INDEX for i, m in zip(ids[1:], mask[1:])]


def _sample_keys(loader, batches):
    """The identifying "#i" of each row's sample (its inputs decoded)."""
    keys = []
    for b in batches:
        for x, _ in _rows(b):
            text = loader.template.tokenizer.decode(x, skip_special_tokens=False)
            keys.append(int(text.split("#", 1)[1].split(" ", 1)[0]))
    return keys


@pytest.mark.filterwarnings("ignore:data.sft. truncated")  # two samples are: their rows are checked too
def test_labels_are_the_next_assistant_token(template):
    from trainer.loss import IGNORE_INDEX as TRAINER_IGNORE

    assert IGNORE_INDEX == TRAINER_IGNORE
    samples = make_samples(40)
    loader = SFTLoader(samples, template, seq_len=64, batch_size=4, seed=1, pad_multiple=8)
    batches = [b for _, b in zip(range(loader.batches_per_epoch), loader)]
    keys = iter(_sample_keys(loader, batches))
    learnt = 0
    for b in batches:
        B, T = b["input_ids"].shape
        assert b["input_ids"].dtype == b["labels"].dtype == torch.long and B == 4
        lengths = []
        for x, y in _rows(b):
            want_x, want_y = _expected_row(template, samples[next(keys)], 64)
            n = len(want_x)
            assert x[:n] == want_x and y[:n] == want_y
            assert x[n:] == [template.pad_id] * (T - n) and y[n:] == [IGNORE_INDEX] * (T - n)
            lengths.append(n)
            learnt += sum(v != IGNORE_INDEX for v in y)
        assert T == min(64, -(-max(lengths) // 8) * 8)
    assert loader.stats["assistant_share"] == learnt / sum(b["labels"].numel() for b in batches)
    # fixed_length: every batch is seq_len wide, the rows unchanged.
    fixed = SFTLoader(samples, template, seq_len=64, batch_size=4, seed=1, fixed_length=True)
    for a, b in zip(batches, fixed):
        assert b["input_ids"].shape == (4, 64) and torch.equal(b["input_ids"][:, : a["input_ids"].shape[1]],
                                                                a["input_ids"])


def test_truncation_and_overlong_prompts(template):
    long_answer = {"messages": [{"role": "user", "content": "#0 q"},
                                {"role": "assistant", "content": "alpha " * 200}]}
    long_prompt = {"messages": [{"role": "user", "content": "#1 " + "beta " * 200},
                                {"role": "assistant", "content": "a"}]}
    samples = [long_answer, long_prompt] + make_samples(10, max_words=3)[2:]
    with pytest.warns(RuntimeWarning) as record:
        loader = SFTLoader(samples, template, seq_len=48, batch_size=3)  # 9 samples left: all in the epoch
    messages = [str(w.message) for w in record]
    assert any("truncated 1 sample" in m for m in messages)
    assert any("skipped 1 sample: prompt longer than seq_len (first: sample 1)" in m for m in messages)
    assert loader.stats["truncated"] == 1 and loader.stats["skipped"] == {"prompt longer than seq_len": 1}
    assert loader.num_samples == 9
    seen = False
    for b in [b for _, b in zip(range(loader.batches_per_epoch), loader)]:
        for x, y in _rows(b):
            if x[-1] != template.pad_id and len(x) == 48:  # the truncated one: 48 positions, loss to the end
                assert _expected_row(template, long_answer, 48) == (x, y) and y[-1] != IGNORE_INDEX
                seen = True
    assert seen


def test_data_ranks_are_disjoint_and_in_step(template):
    samples = make_samples(70)
    D, B = 3, 4
    loaders = [SFTLoader(samples, template, seq_len=128, batch_size=B, data_rank=r, data_ranks=D, seed=3,
                         bucket_size=24) for r in range(D)]
    n = loaders[0].batches_per_epoch
    assert n == 5 and all(ld.batches_per_epoch == n for ld in loaders)  # 70 = 2 buckets of 24 + 22: 2 + 2 + 1 steps
    per_rank = [[b for _, b in zip(range(n), ld)] for ld in loaders]
    keys = [_sample_keys(ld, bs) for ld, bs in zip(loaders, per_rank)]
    flat = [k for ks in keys for k in ks]
    assert len(flat) == len(set(flat)) == n * D * B, "every sample at most once per epoch, across all ranks"
    # One step's D x B samples come from one sorted bucket: rank r's rows are the r-th B of them.
    for step in range(n):
        lengths = [sorted(int((b["input_ids"][i] != template.pad_id).sum()) for i in range(B))
                   for b in (per_rank[r][step] for r in range(D))]
        assert all(lengths[r][-1] <= lengths[r + 1][0] for r in range(D - 1))
    # Another epoch permutes again: the samples that sat out epoch 0 are read in epoch 1.
    second = [_sample_keys(ld, [b for _, b in zip(range(n), ld)]) for ld in loaders]
    assert set(k for ks in second for k in ks) != set(flat)


def test_bucketing_pads_less_than_random_batches(template):
    samples = make_samples(256, seed=5, max_words=60)
    shares = measure_padding(samples, template, seq_len=256, batch_size=8)
    assert shares["bucketed"] < 0.5 * shares["random"] and shares["random"] < shares["fixed_length"] < 1
    loader = SFTLoader(samples, template, seq_len=256, batch_size=8)
    for _, _b in zip(range(loader.batches_per_epoch), loader):
        pass
    assert loader.stats["padding_share"] == pytest.approx(shares["bucketed"], abs=1e-12)
    assert 0 < loader.stats["assistant_share"] < 1 - loader.stats["padding_share"]


def test_resume_yields_the_same_next_batches(template):
    samples = make_samples(30)
    kw = dict(seq_len=128, batch_size=4, data_rank=1, data_ranks=2, seed=7, bucket_size=8)
    full = SFTLoader(samples, template, **kw)
    assert full.batches_per_epoch == 3
    it = iter(full)
    reference = [next(it) for _ in range(8)]  # crosses two epoch boundaries
    for cut in (0, 2, 3, 5):
        first = SFTLoader(samples, template, **kw)
        it = iter(first)
        for _ in range(cut):
            next(it)
        state = json.loads(json.dumps(first.state_dict()))  # plain types: checkpointable as they are
        resumed = SFTLoader(samples, template, **kw)
        resumed.load_state_dict(state)
        assert resumed.stats == first.stats
        for want, got in zip(reference[cut:], resumed):
            assert torch.equal(want["input_ids"], got["input_ids"]) and torch.equal(want["labels"], got["labels"])
    with pytest.raises(ValueError, match="other samples or another layout"):
        SFTLoader(samples[:-1], template, **kw).load_state_dict(state)
    with pytest.raises(ValueError, match="other samples or another layout"):
        SFTLoader(samples, template, **{**kw, "data_ranks": 3}).load_state_dict(state)


def _write_jsonl(path, samples, bad_lines=()):
    lines = [json.dumps(s) for s in samples]
    for at, line in bad_lines:
        lines.insert(at, line)
    path.write_text("\n".join(lines) + "\n\n")  # a trailing blank line is not a sample


def test_malformed_lines_are_skipped_counted_and_warned_once(template, tmp_path):
    samples = make_samples(12)
    bad = [(0, "{not json"), (3, '{"messages": []}'), (5, "[1, 2]"), (7, '{"messages": [{"role": "user", "content"'),
           (9, '{"messages": [{"role": "user", "content": "q"}]}'), (10, "\xff\xfe")]
    path = tmp_path / "chat.jsonl"
    _write_jsonl(path, samples, bad)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loader = SFTLoader(str(path), template, seq_len=128, batch_size=4)
    messages = sorted(str(w.message) for w in record)
    assert messages == sorted([
        f"data.sft: skipped 3 samples: not valid JSON (first: {path}:1)",
        f"data.sft: skipped 1 sample: 'messages' is empty (first: {path}:4)",
        f"data.sft: skipped 1 sample: not a JSON object (first: {path}:6)",
        f"data.sft: skipped 1 sample: no assistant turn (first: {path}:10)",
    ])
    assert loader.stats["skipped"] == {"not valid JSON": 3, "'messages' is empty": 1, "not a JSON object": 1,
                                       "no assistant turn": 1}
    assert loader.num_samples == len(samples)
    # Counted the same when the source is read first (to split it) and the counts are passed on.
    with pytest.warns(RuntimeWarning):
        parsed, skipped = load_samples(path)
    assert skipped == {"not valid JSON": 3} and len(parsed) == len(samples) + 3
    with pytest.warns(RuntimeWarning):
        again = SFTLoader(parsed, template, seq_len=128, batch_size=4, skipped=skipped)
    assert again.stats["skipped"] == loader.stats["skipped"]


def test_webdataset_shards_directories_and_globs_read_like_jsonl(template, tmp_path):
    import webdataset as wds

    samples = make_samples(20)
    _write_jsonl(tmp_path / "chat.jsonl", samples)
    shards = tmp_path / "shards"
    shards.mkdir()
    for s in range(2):
        with wds.TarWriter(str(shards / f"chat-{s:06d}.tar")) as sink:
            for i in range(10 * s, 10 * s + 10):
                sink.write({"__key__": f"{i:06d}", "json": samples[i], "txt": "ignored"})
    with wds.TarWriter(str(shards / "chat-000002.tar")) as sink:  # a sample without its json member is skipped
        sink.write({"__key__": "lonely", "txt": "no json here"})

    def batches(source):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            loader = SFTLoader(source, template, seq_len=128, batch_size=4, seed=2)
        return [b for _, b in zip(range(loader.batches_per_epoch), loader)], loader, record

    want, _, _ = batches(samples)
    for source in (tmp_path / "chat.jsonl", str(shards), str(shards / "chat-*.tar"),
                   [shards / "chat-000000.tar", str(shards / "chat-000001.tar")]):
        got, loader, record = batches(source)
        assert len(got) == len(want) == 5
        for a, b in zip(want, got):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
        lonely = loader.stats["skipped"].get("tar sample without a json member", 0)
        assert lonely == (source in (str(shards), str(shards / "chat-*.tar"))) and len(record) == lonely
    with pytest.raises(FileNotFoundError, match="matches no"):
        SFTLoader(str(tmp_path / "none-*.jsonl"), template, seq_len=128, batch_size=4)


def test_split_samples():
    samples = list(range(50))
    train, held = split_samples(samples, 0.1, seed=3)
    assert len(held) == 5 and sorted(train + held) == samples and train == sorted(train) and held == sorted(held)
    assert split_samples(samples, 0.1, seed=3) == (train, held) and split_samples(samples, 0.1, seed=4) != (train, held)
    assert len(split_samples(samples, 7)[1]) == 7 and split_samples(samples, 0) == (samples, [])
    assert len(split_samples(samples, 0.001)[1]) == 1, "a non-zero fraction holds out at least one sample"
    for bad in (1.0, -0.1, 51, -1, "5"):
        with pytest.raises(ValueError, match="held_out"):
            split_samples(samples, bad)


def test_too_few_samples_for_a_step(template):
    with pytest.raises(ValueError, match="fewer than one step"):
        SFTLoader(make_samples(5), template, seq_len=128, batch_size=3, data_ranks=2)
    assert SFTLoader(make_samples(6), template, seq_len=128, batch_size=3, data_ranks=2).batches_per_epoch == 1
