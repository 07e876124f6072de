"""The reader (data/loader.py).

Proves: batches are LongTensor [B, T] with labels = inputs shifted by one and rows overlapping by one token;
the packed stream is exactly the documents joined by <eos>, in prepared order when shuffle is off, with
nothing dropped across batches and epochs; 2 ranks x 2 DataLoader workers read every document exactly once
per epoch (shard count not divisible by the reader count); a resumed loader (state through JSON, fresh
object) yields exactly the uninterrupted run's batches and reports the same positions after them, with 0 and
2 workers, across chunk, document and epoch boundaries; shuffling is seeded (same seed, same batches; other
seed, other order); corrupt and truncated shards are skipped with a warning naming them and counted (also
through workers) while the others still arrive; too few shards, all-broken shards and a state from another
layout are clear errors.
"""

import json
import os
from collections import Counter
from itertools import islice

import numpy as np
import pytest
import torch

from data.loader import PackedLoader, epoch_shards
from tests.data.synthetic import EOS, split_docs, write_synthetic_shards

B, T = 2, 8
SHARDS = [3, 5, 2, 6, 4, 1, 5, 3, 4, 2]  # 10 shards: not divisible by 4 readers, uneven sizes


def _loader(path, **kw):
    args = dict(seq_len=T, batch_size=B, eos_id=EOS, seed=3, shuffle=True, shuffle_buffer=3)
    return PackedLoader(str(path), **{**args, **kw})


def _take(loader, n):
    return list(islice(iter(loader), n))


def _stream(batches):
    """The token stream behind consecutive batches of one reader: rows tile it every T tokens."""
    return np.concatenate([b["input_ids"].reshape(-1).numpy() for b in batches])


@pytest.fixture
def shards(tmp_path):
    return tmp_path, write_synthetic_shards(tmp_path, SHARDS)


def test_batch_shape_and_shift(shards):
    root, _ = shards
    batches = _take(_loader(root), 6)
    for b in batches:
        assert set(b) == {"input_ids", "labels"}
        assert b["input_ids"].shape == b["labels"].shape == (B, T) and b["input_ids"].dtype == torch.long
        # Within a batch: labels are inputs shifted by one, and row r's last label is row r+1's first input.
        flat_in, flat_lab = b["input_ids"].reshape(-1), b["labels"].reshape(-1)
        assert torch.equal(flat_lab[:-1], flat_in[1:])
    for a, b in zip(batches, batches[1:]):  # ... and across batches
        assert a["labels"][-1, -1] == b["input_ids"][0, 0]


def test_unshuffled_stream_is_documents_joined_by_eos(shards):
    root, per_shard = shards
    docs = [d for s in per_shard for d in s]
    expected = np.concatenate([np.append(d, EOS) for d in docs] * 2)  # two epochs back to back
    loader = _loader(root, shuffle=False)
    stream = _stream(_take(loader, len(expected) // (B * T)))
    assert np.array_equal(stream, expected[: len(stream)])
    assert loader.epoch == 1


def _epoch_docs(streams, per_shard, num_readers, seed, shuffle=True):
    """Each reader's first-epoch documents, cut from its packed stream."""
    out = []
    for g, stream in enumerate(streams):
        n = sum(len(per_shard[i]) for i in epoch_shards(len(per_shard), 0, seed, shuffle, g, num_readers))
        docs = split_docs(stream)
        assert len(docs) >= n, "stream too short for one epoch"
        out.extend(docs[:n])
    return out


def test_two_ranks_two_workers_cover_an_epoch_exactly_once(shards):
    root, per_shard = shards
    all_docs = [d for s in per_shard for d in s]
    streams = []
    for rank in range(2):
        loader = _loader(root, num_workers=2, rank=rank, world_size=2)
        batches = _take(loader, 2 * 40)
        # DataLoader alternates workers: even batches come from local reader 0, odd ones from reader 1.
        streams += [_stream(batches[0::2]), _stream(batches[1::2])]
    got = _epoch_docs(streams, per_shard, num_readers=4, seed=3)
    key = lambda d: tuple(d.tolist())  # noqa: E731
    assert Counter(map(key, got)) == Counter(map(key, all_docs))
    # The four readers really hold different shards, and together all of them.
    assigned = [epoch_shards(len(SHARDS), 0, 3, True, g, 4) for g in range(4)]
    assert sorted(i for a in assigned for i in a) == list(range(len(SHARDS)))


def test_shuffle_is_seeded(shards):
    root, per_shard = shards
    run = lambda seed: _stream(_take(_loader(root, seed=seed), 30))  # noqa: E731
    a, b, c = run(3), run(3), run(4)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    in_order = np.concatenate([np.append(d, EOS) for s in per_shard for d in s])
    assert not np.array_equal(a, in_order[: len(a)])
    # Shuffled or not, one epoch holds every document once.
    assert sorted(map(len, _epoch_docs([_stream(_take(_loader(root), 80))], per_shard, 1, 3))) == \
        sorted(len(d) for s in per_shard for d in s)


def _with_states(loader, n):
    """n batches, each with the loader's state right after it (as JSON text)."""
    return [(b, json.dumps(loader.state_dict())) for b in islice(iter(loader), n)]


def _resume_equal(root, num_workers, n, m, reference):
    first = _loader(root, num_workers=num_workers)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, (y, _) in zip(_take(first, n), reference))
    state = json.loads(json.dumps(first.state_dict()))  # plain types only: must survive JSON
    resumed = _loader(root, num_workers=num_workers)
    resumed.load_state_dict(state)
    for i, (b, after) in enumerate(_with_states(resumed, m)):
        ref, ref_after = reference[n + i]
        assert torch.equal(b["input_ids"], ref["input_ids"]) and torch.equal(b["labels"], ref["labels"]), \
            f"batch {n + i} differs after resuming at {n}"
        assert after == ref_after, f"position after batch {n + i} differs after resuming at {n}"


def test_resume_is_exact_in_process(shards):
    root, _ = shards
    # One epoch is ~60 batches here: resuming at every third n up to past the epoch end covers chunk starts and
    # ends, saves inside long documents (carry > one batch) and the epoch boundary.
    reference = _with_states(_loader(root), 78)
    for n in range(0, 66, 3):
        _resume_equal(root, 0, n, 12, reference)


def test_resume_is_exact_with_workers(shards):
    root, _ = shards
    # Each of the two readers ends its epoch after ~30 of its batches, i.e. ~60 loader batches.
    reference = _with_states(_loader(root, num_workers=2), 80)
    for n in (5, 24, 57, 63):  # odd n: the next batch comes from worker 1, so the restore must rotate readers
        _resume_equal(root, 2, n, 12, reference)


def test_state_from_another_layout_is_refused(shards):
    root, _ = shards
    loader = _loader(root, num_workers=2)
    _take(loader, 3)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="num_readers=2"):
        _loader(root, num_workers=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=3"):
        _loader(root, num_workers=2, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="dp_rank_1"):
        _loader(root, num_workers=2, rank=1, world_size=2).load_state_dict(state)
    # seq_len and batch_size may change on resume (sequence-length extension): the position is in tokens.
    longer = _loader(root, num_workers=2, seq_len=2 * T)
    longer.load_state_dict(state)
    assert _take(longer, 1)[0]["input_ids"].shape == (B, 2 * T)


def _break(root, per_shard):
    (root / "shard-000002.tar").write_bytes(os.urandom(4096))  # garbage
    data = (root / "shard-000006.tar").read_bytes()
    (root / "shard-000006.tar").write_bytes(data[: len(data) // 2])  # truncated
    return [d for i, s in enumerate(per_shard) if i not in (2, 6) for d in s]


def test_broken_shards_are_skipped_warned_and_counted(shards):
    root, per_shard = shards
    survivors = _break(root, per_shard)
    loader = _loader(root, shuffle=False)
    with pytest.warns(RuntimeWarning) as caught:
        stream = _stream(_take(loader, 60))
    messages = " ".join(str(w.message) for w in caught)
    assert "shard-000002.tar" in messages and "shard-000006.tar" in messages
    got = split_docs(stream)[: len(survivors)]
    assert [d.tolist() for d in got] == [d.tolist() for d in survivors]
    assert loader.skipped_shards == 2
    assert loader.state_dict()["dp_rank_0"]["readers"][0]["skipped"] == ["shard-000002.tar", "shard-000006.tar"]


def test_skipped_count_reaches_the_loader_through_workers(shards):
    root, per_shard = shards
    _break(root, per_shard)
    loader = _loader(root, num_workers=2)
    _take(loader, 80)  # past one epoch (~30 batches) of both readers
    assert loader.skipped_shards == 2


def test_reader_survives_an_epoch_of_only_broken_shards(tmp_path):
    # 3 shards, 3 readers: each epoch deals every reader one shard, so reader 0 meets the broken one in some
    # epochs and must carry on with the good ones in the others.
    per_shard = write_synthetic_shards(tmp_path, [4, 4, 4])
    (tmp_path / "shard-000001.tar").write_bytes(b"junk")
    loader = _loader(tmp_path, rank=0, world_size=3)
    with pytest.warns(RuntimeWarning, match="shard-000001.tar"):
        docs = split_docs(_stream(_take(loader, 40)))
    good = {tuple(d.tolist()) for i in (0, 2) for d in per_shard[i]}
    assert {tuple(d.tolist()) for d in docs} == good
    broken_epochs = [e for e in range(loader.epoch) if epoch_shards(3, e, 3, True, 0, 3) == [1]]
    assert broken_epochs, "the seed should deal reader 0 the broken shard at least once"


def test_errors(shards, tmp_path):
    root, _ = shards
    with pytest.raises(ValueError, match="10 shards, fewer than .* 12 readers"):
        _loader(root, num_workers=3, world_size=4)
    with pytest.raises(FileNotFoundError, match="python -m data.prepare"):
        _loader(tmp_path / "missing")
    for name in os.listdir(root):
        if name.endswith(".tar"):
            (root / name).write_bytes(b"junk")
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="no readable document"):
        _take(_loader(root), 1)
