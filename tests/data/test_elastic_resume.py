"""Elastic resume of the reader (data/loader.py): a position saved with G readers continues with G' readers.

Proves, on 10 uneven shards (35 documents, each identified by its first token) read by in-process readers whose
every packed document is recorded with the epoch it belongs to:
- G = 4 -> G' = 2, 3, 1 (ranks emulated by PackedLoader's rank / world_size), saved at several points (inside the
  first epoch, with readers spread over two epochs, over three): read until every new reader has finished epoch
  e_max + 1, every epoch <= e_max + 1 has read each document exactly once (old part + drained part + new epochs);
  each reader's batches are [B, T] windows of its token stream (labels = inputs shifted by one), and that stream
  is its initial carry followed by exactly the recorded documents, each + <eos>: nothing lost at the switch, and
  the old readers' carries are the new readers' initial carries (old reader r's to new reader r mod G');
  the leftover documents are dealt evenly (loads differ by at most one shard).

The rest of what it proves: docs/testing.md#elastic-resume-of-the-reader
"""

import json
import logging
import pickle
from collections import Counter
from itertools import islice

import numpy as np
import pytest
import torch

from data.loader import PackedLoader, _Reader
from tests.data.synthetic import EOS, MARK, write_synthetic_shards
from trainer.checkpoint import Checkpointer, RankLocalState
from trainer.checkpoint.checkpointer import _rng_state
from trainer.config import CheckpointConfig

B, T = 2, 8
SHARDS = [3, 5, 2, 6, 4, 1, 5, 3, 4, 2]  # 35 documents; chunks of 3 cross shard boundaries
NUM_DOCS = sum(SHARDS)


@pytest.fixture
def corpus(tmp_path):
    """(shard directory, every document as int64 tokens by id)."""
    per_shard = write_synthetic_shards(tmp_path, SHARDS)
    return tmp_path, [d.astype(np.int64) for s in per_shard for d in s]


@pytest.fixture
def root(corpus):
    return corpus[0]


@pytest.fixture
def documents(corpus):
    return corpus[1]


@pytest.fixture
def records(monkeypatch):
    """{(phase, reader): [(epoch, document id, tokens), ...]}: what each in-process reader packed, in order."""
    out: dict = {}
    phase = ["?"]
    original = _Reader._stream

    def spy(self):
        pending = self.state.get("pending") or []
        mine = out.setdefault((phase[0], self.reader), [])
        for position, tokens in original(self):
            drain = position[4]
            epoch = pending[drain[0]]["epoch"] if drain is not None else position[0]
            mine.append((epoch, int(tokens[0]) - MARK, np.asarray(tokens, dtype=np.int64)))
            yield position, tokens

    monkeypatch.setattr(_Reader, "_stream", spy)
    out["phase"] = phase
    return out


def _loader(root, rank=0, world=1, workers=0, **kw):
    args = dict(seq_len=T, batch_size=B, eos_id=EOS, seed=3, shuffle=True, shuffle_buffer=3)
    return PackedLoader(str(root), rank=rank, world_size=world, num_workers=workers, **{**args, **kw})


def _merged(loaders) -> dict:
    """Every rank's state in one dict, through JSON (plain types only)."""
    out = {}
    for ld in loaders:
        out.update(ld.state_dict())
    return json.loads(json.dumps(out))


class Phase:
    """One layout's in-process readers (1 per rank), loaded from `state` (elastically) or fresh."""

    def __init__(self, root, records, name, world, state=None):
        self.records, self.name, self.world = records, name, world
        self.loaders = [_loader(root, rank, world) for rank in range(world)]
        if state is not None:
            for ld in self.loaders:
                ld.load_state_dict(state, elastic=True)
        self.initial = [ld.state_dict()[f"dp_rank_{r}"]["readers"][0] for r, ld in enumerate(self.loaders)]
        self.iters = [iter(ld) for ld in self.loaders]
        self.batches = [[] for _ in range(world)]

    def step(self, rank):
        self.records["phase"][0] = self.name
        self.batches[rank].append(next(self.iters[rank]))

    def run(self, n):
        for _ in range(n):
            for rank in range(self.world):
                self.step(rank)

    def run_past(self, epoch):
        """Until every reader has begun the epoch after `epoch` (so it finished `epoch` and all before)."""
        for rank in range(self.world):
            while self.loaders[rank].epoch <= epoch or not _begun(self.loaders[rank]):
                self.step(rank)

    def check_streams(self):
        """Batches are windows of the reader's stream = initial carry + its recorded documents, each + <eos>."""
        for rank, batches in enumerate(self.batches):
            docs = self.records.get((self.name, rank), [])
            packed = np.concatenate([np.asarray(self.initial[rank]["carry"], np.int64)]
                                    + [np.append(tokens, EOS) for _, _, tokens in docs] + [np.zeros(0, np.int64)])
            final = np.asarray(self.loaders[rank].state_dict()[f"dp_rank_{rank}"]["readers"][0]["carry"])
            inputs = [b["input_ids"] for b in batches]
            assert all(x.shape == (B, T) and x.dtype == torch.long for x in inputs)
            stream = np.concatenate([x.reshape(-1).numpy() for x in inputs] + [final])
            assert np.array_equal(stream, packed), f"{self.name} reader {rank}: stream is not carry + documents"
            for i, b in enumerate(batches):
                assert np.array_equal(b["labels"].reshape(-1).numpy(), stream[i * B * T + 1:(i + 1) * B * T + 1])

    def state(self):
        return _merged(self.loaders)


def _begun(loader) -> bool:
    s = loader._states[0]
    return not s.get("pending") and (s["shard"], s["doc"], s["taken"]) != (0, 0, 0)


def _check_epochs(records, documents, last_epoch, expected=Counter(range(NUM_DOCS))):
    """Every epoch <= last_epoch read each (readable) document exactly once, over all phases; documents intact."""
    per_epoch: dict[int, Counter] = {}
    for key, docs in records.items():
        if key == "phase":
            continue
        for epoch, doc, tokens in docs:
            per_epoch.setdefault(epoch, Counter())[doc] += 1
            assert np.array_equal(tokens, documents[doc]), f"document {doc} altered"
    for e in range(last_epoch + 1):
        got = per_epoch.get(e, Counter())
        assert got == expected, \
            f"epoch {e}: missing {sorted(set(expected) - set(got))}, twice {[d for d, c in got.items() if c > 1]}"


def _last_begun(merged: dict) -> int:
    """e_max: the highest epoch a reader of this saved state has begun."""
    readers = [r for v in merged.values() for r in v["readers"]]
    return max(s["epoch"] if (s["shard"], s["doc"], s["taken"]) != (0, 0, 0) and not s.get("pending")
               else s["epoch"] - 1 for s in readers)


def _pending_docs(state) -> int:
    return sum(len(seg["docs"]) if "docs" in seg else SHARDS[seg["shard"]] - seg["from"]
               for seg in state.get("pending", []))


@pytest.mark.parametrize("new, n", [(2, 17), (3, 17), (1, 17), (3, 5), (2, 40)])
def test_elastic_resume_reads_every_document_once_per_epoch(root, records, documents, new, n, caplog):
    old = Phase(root, records, "old", 4)
    old.run(n)
    old.check_streams()
    saved = old.state()
    old_readers = [saved[f"dp_rank_{r}"]["readers"][0] for r in range(4)]
    last = _last_begun(saved)
    if n == 40:
        assert len({s["epoch"] for s in old_readers}) > 1, "readers should be spread over epochs here"

    with caplog.at_level(logging.INFO, logger="data.loader"):
        resumed = Phase(root, records, "new", new, saved)
    assert f"elastic resume from 4 to {new} readers" in caplog.text
    for g, s in enumerate(resumed.initial):
        assert s["epoch"] == last + 1
        expected = np.concatenate([old_readers[r]["carry"] for r in range(g, 4, new)] + [[]])
        assert np.array_equal(s["carry"], expected), "old carries must become the new readers' carries"
    loads = [_pending_docs(s) for s in resumed.initial]
    assert max(loads) - min(loads) <= max(SHARDS)
    resumed.run_past(last + 1)
    resumed.check_streams()
    _check_epochs(records, documents, last + 1)


def test_unreadable_shard_is_skipped_on_both_sides(root, records, documents):
    (root / "shard-000003.tar").write_bytes(b"junk")  # documents 10..15
    readable = Counter(d for d in range(NUM_DOCS) if not 10 <= d < 16)
    with pytest.warns(RuntimeWarning, match="shard-000003.tar"):
        old = Phase(root, records, "old", 4)
        old.run(17)
        saved = old.state()
        assert any(s["skipped"] for s in (saved[f"dp_rank_{r}"]["readers"][0] for r in range(4)))
        last = _last_begun(saved)
        new = Phase(root, records, "new", 3, saved)
        new.run_past(last + 1)
    old.check_streams()
    new.check_streams()
    _check_epochs(records, documents, last + 1, readable)


# (5, 3) and (15, 6) stop inside a {docs} segment (the rest of a chunk begun by an old reader)
@pytest.mark.parametrize("a_steps, b_steps", [(23, 1), (23, 4), (5, 3), (15, 6)])
def test_chain_of_elastic_resumes_with_an_exact_resume_inside_the_drain(root, records, documents, a_steps, b_steps):
    a = Phase(root, records, "a", 4)
    a.run(a_steps)
    b = Phase(root, records, "b", 3, a.state())
    assert all(s.get("pending") for s in b.initial)
    b.run(b_steps)
    b.check_streams()
    assert any(ld._states[0].get("pending") for ld in b.loaders), "b should stop inside its drain"
    mid = b.state()

    # Same layout, saved in the middle of the drain: the resumed readers replay the uninterrupted ones exactly.
    for r in range(3):
        replay = _loader(root, r, 3)
        assert replay.resumes_exactly(mid)
        replay.load_state_dict(json.loads(json.dumps(mid)))  # not elastic: the exact path
        it = iter(replay)
        for _ in range(6):
            records["phase"][0] = "replay"  # (what the replay packs is not part of the run)
            x = next(it)
            b.step(r)
            y = b.batches[r][-1]
            assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])
            assert replay.state_dict() == b.loaders[r].state_dict()
        records.pop(("replay", r), None)
    b.check_streams()

    state_b = b.state()
    last = _last_begun(state_b)
    c = Phase(root, records, "c", 2, state_b)
    c.run_past(last + 1)
    c.check_streams()
    _check_epochs(records, documents, last + 1)


def test_same_reader_count_split_otherwise_continues_each_reader(root):
    n, m = 9, 7
    reference = []
    for r in range(4):  # the uninterrupted readers, one per rank
        reference.append(list(islice(iter(_loader(root, r, 4)), n + m)))
    two_by_two = [_loader(root, r, 2, workers=2) for r in range(2)]
    for ld in two_by_two:
        list(islice(iter(ld), 2 * n))  # workers alternate: n batches of each of the rank's 2 readers
    state = _merged(two_by_two)
    for r in range(4):
        ld = _loader(root, r, 4)
        assert not ld.resumes_exactly(state)
        ld.load_state_dict(state, elastic=True)
        for x, y in zip(islice(iter(ld), m), reference[r][n:]):
            assert torch.equal(x["input_ids"], y["input_ids"])


def test_drain_through_workers_matches_in_process_and_resumes_exactly(root):
    olds = [_loader(root, r, 4) for r in range(4)]
    for ld in olds:
        list(islice(iter(ld), 15))
    saved = _merged(olds)
    in_process = [_loader(root, r, 2) for r in range(2)]
    for ld in in_process:
        ld.load_state_dict(saved, elastic=True)
    ref = [list(islice(((b, ld.state_dict()[f"dp_rank_{r}"]["readers"][0]) for b in iter(ld)), 12))
           for r, ld in enumerate(in_process)]
    workers = _loader(root, 0, 1, workers=2)
    workers.load_state_dict(saved, elastic=True)
    got = [(b, workers.state_dict()["dp_rank_0"]["readers"][i % 2]) for i, b in enumerate(islice(iter(workers), 16))]
    for i, (b, state) in enumerate(got):
        rb, rstate = ref[i % 2][i // 2]
        assert torch.equal(b["input_ids"], rb["input_ids"]) and torch.equal(b["labels"], rb["labels"])
        assert json.dumps(state) == json.dumps(rstate)
    assert any(s.get("pending") for s in workers._states), "should still be draining"
    # Saved with workers inside the drain, resumed in the same layout: the batches the in-process readers made next.
    again = _loader(root, 0, 1, workers=2)
    again.load_state_dict(json.loads(json.dumps(workers.state_dict())))
    for i, b in enumerate(islice(iter(again), 8), start=16):
        assert torch.equal(b["input_ids"], ref[i % 2][i // 2][0]["input_ids"])


def test_elastic_refusals(root):
    olds = [_loader(root, r, 2) for r in range(2)]
    for ld in olds:
        list(islice(iter(ld), 3))
    saved = _merged(olds)
    with pytest.raises(ValueError, match=r"every saved data rank: \['dp_rank_1'\] missing"):
        _loader(root).load_state_dict({"dp_rank_0": saved["dp_rank_0"]}, elastic=True)
    with pytest.raises(ValueError, match="seed=3"):
        _loader(root, seed=4).load_state_dict(saved, elastic=True)
    with pytest.raises(ValueError, match="num_readers=2"):
        _loader(root).load_state_dict(saved)  # without elastic: refused as before


# --- trainer/checkpoint/checkpointer.py: the load path with another number of data ranks -----------------------------------------


class _SavedRanks:
    """Stateful standing in for a run's ranks at save time: each data rank's position, global rank 0's RNG."""

    def __init__(self, loaders):
        self.loaders = loaders

    def state_dict(self):
        out = {f"data_rank{d}": pickle.dumps(ld.state_dict()) for d, ld in enumerate(self.loaders)}
        return {**out, "rng_rank0": pickle.dumps(_rng_state())}

    def load_state_dict(self, state):
        raise AssertionError("only saved here")


def test_checkpoint_resumes_the_data_position_with_another_data_rank_count(root, tmp_path, monkeypatch):
    olds = [_loader(root, d, 2) for d in range(2)]
    for ld in olds:
        list(islice(iter(ld), 11))
    merged = _merged(olds)
    path = Checkpointer(tmp_path / "ckpt", CheckpointConfig()).save(11, {"rank_local": _SavedRanks(olds)})
    ckpt = Checkpointer(tmp_path / "ckpt", CheckpointConfig())

    for world in (1, 3):
        for d in range(world):
            ld, direct = _loader(root, d, world), _loader(root, d, world)
            ckpt.load(path, {"rank_local": RankLocalState(ld, rank=d, data_rank=d)})
            direct.load_state_dict(merged, elastic=True)
            assert json.dumps(ld.state_dict()) == json.dumps(direct.state_dict())
            assert torch.equal(next(iter(ld))["input_ids"], next(iter(direct))["input_ids"])

    # The same layout takes the exact path: only its own position is read.
    monkeypatch.setattr(RankLocalState, "_all_data_positions", lambda self: pytest.fail("read all positions"))
    ld = _loader(root, 1, 2)
    ckpt.load(path, {"rank_local": RankLocalState(ld, rank=1, data_rank=1)})
    assert ld.state_dict() == olds[1].state_dict()



# --- the trainer CLI: 2 data ranks (torchrun, gloo) -> 1 process -> 2 data ranks again ------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_trainer_resumes_with_another_number_of_data_ranks(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from data.config import DataConfig, ensure_prepared
    from tests.trainer.harness import micro_overrides, read_metrics, run_cli, run_ranks

    data = tmp_path / "data"
    ensure_prepared(DataConfig(path=str(data), max_bytes=400_000, shard_size=16_384), progress=False)

    def run(ranks, name, steps, resume=None):
        args = micro_overrides(tmp_path / name, data, "checkpoint.interval=2", f"trainer.max_steps={steps}",
                               "data.num_workers=0", *([f"checkpoint.resume={resume}"] if resume else []))
        if ranks == 1:
            r = run_cli(args)
        else:
            r = run_ranks(ranks, args)  # torchrun's ranks, forked (tests/trainer/harness.py)
        assert r.returncode == 0, r.stderr[-3000:]
        return r.stdout + r.stderr

    run(2, "dp2", 4)
    ckpt = tmp_path / "dp2" / "checkpoints" / "step_00000002"
    saved = {k for k in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if ".data_rank" in k}
    assert saved == {"rank_local.data_rank0", "rank_local.data_rank1"}
    out = run(1, "one", 6, ckpt)
    assert "elastic resume from 2 to 1 readers" in out and "resumed from" in out
    assert [r["step"] for r in read_metrics(tmp_path / "one")] == [3, 4, 5, 6]
    out = run(2, "dp2_again", 6, tmp_path / "one" / "checkpoints" / "step_00000004")  # and elastic again, 1 -> 2
    assert "elastic resume from 1 to 2 readers" in out
    assert [r["step"] for r in read_metrics(tmp_path / "dp2_again")] == [5, 6]
