"""Reading prepared shards: split over ranks and workers, shuffled, packed into windows, resumable.

Contract: `PackedLoader` is an infinite iterable of {"input_ids", "labels"} LongTensor [B, T] batches (B =
data.batch_size, T = data.seq_len) for one data-parallel rank; labels are the inputs shifted by one (windows of
T + 1 tokens every T tokens; documents end in <eos>, nothing is padded or dropped, attention is not masked at
document boundaries). Each shard is read by exactly one of the world_size x max(1, num_workers) readers per epoch
(fewer shards than readers is refused); every rank always has a next batch. `state_dict()` / `load_state_dict()`
resume exactly (the same batches as an uninterrupted run) under the same layout, and with `elastic=True` and every
saved data rank's state also under another number of readers, without losing or repeating a document
(`elastic_split`). Unreadable shards are skipped with a warning (`skipped_shards`).

Design and reasoning: docs/data.md#packed-pretraining-reader
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import logging
import os
import warnings
from collections.abc import Iterator
from itertools import islice

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data.shards import ShardError, ShardInfo, read_meta, read_shard

STATE_VERSION = 2  # 2 adds the optional "pending" / "pending_pos" of an elastic resume; version 1 still loads
_LOADABLE_VERSIONS = (1, 2)
_DRAIN = 1  # ends a drained chunk's seed: (seed, epoch, shard, from, offset, 1) never equals an epoch chunk's seed

log = logging.getLogger(__name__)


def fresh_state() -> dict:
    return {"epoch": 0, "shard": 0, "doc": 0, "taken": 0, "carry": [], "skipped": []}


@functools.lru_cache(maxsize=4)  # an elastic resume asks for every old reader's list of the same few epochs
def _epoch_order(num_shards: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_shards) if shuffle else np.arange(num_shards)


def epoch_shards(num_shards: int, epoch: int, seed: int, shuffle: bool, reader: int, num_readers: int) -> list[int]:
    """Indices (into meta.json's shard list) that `reader` of `num_readers` reads in `epoch`, in order."""
    return _epoch_order(num_shards, epoch, seed, shuffle)[reader::num_readers].tolist()


class _Reader:
    """One reader's infinite stream of (batch, state after this batch)."""

    def __init__(self, root: str, shards: list[ShardInfo], dtype: str, *, reader: int, num_readers: int,
                 seq_len: int, batch_size: int, seed: int, shuffle: bool, shuffle_buffer: int, eos_id: int,
                 state: dict):
        self.root, self.shards, self.dtype = root, shards, dtype
        self.reader, self.num_readers = reader, num_readers
        self.seq_len, self.batch_size = seq_len, batch_size
        self.seed, self.shuffle, self.shuffle_buffer, self.eos_id = seed, shuffle, shuffle_buffer, eos_id
        self.state = state
        self.skipped = set(state["skipped"])
        self._cached: tuple[int, list[np.ndarray] | None] | None = None

    def _load(self, index: int) -> list[np.ndarray] | None:
        """The shard's documents, or None (after a warning) when it is unreadable."""
        if self._cached is not None and self._cached[0] == index:
            return self._cached[1]
        info = self.shards[index]
        path = os.path.join(self.root, info.name)
        try:
            docs = read_shard(path, info, self.dtype)
        except ShardError as exc:
            self.skipped.add(info.name)
            warnings.warn(f"data: skipping shard {path}: {exc}", RuntimeWarning, stacklevel=2)
            docs = None
        self._cached = (index, docs)
        return docs

    def _docs(self, epoch: int, shard: int, doc: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """(shard position, document index, tokens) of this reader's epoch, from (shard, doc) on."""
        mine = epoch_shards(len(self.shards), epoch, self.seed, self.shuffle, self.reader, self.num_readers)
        for pos in range(shard, len(mine)):
            docs = self._load(mine[pos])
            if docs is None:
                continue
            for i in range(doc if pos == shard else 0, len(docs)):
                yield pos, i, docs[i]

    def _segment(self, seg: dict) -> list[np.ndarray]:
        """A pending segment's documents (those of unreadable shards left out, after a warning)."""
        if "docs" in seg:
            loaded = {s: self._load(s) for s in dict.fromkeys(s for s, _ in seg["docs"])}  # each shard once
            return [loaded[s][d] for s, d in seg["docs"] if loaded[s] is not None]
        docs = self._load(seg["shard"])
        return [] if docs is None else docs[seg["from"]:]

    def _drain(self, j0: int, t0: int) -> Iterator[tuple[tuple[int, int, int], np.ndarray]]:
        """The pending segments' documents from (chunk offset j0 of the first, t0 of it taken), each with the drain
        position (segment index, chunk offset, taken) just after it."""
        pending = self.state.get("pending") or []
        for k, seg in enumerate(pending):
            docs = self._segment(seg)
            taken = t0 if k == 0 else 0
            for j in range(j0 if k == 0 else 0, len(docs), self.shuffle_buffer):
                chunk = docs[j : j + self.shuffle_buffer]
                if self.shuffle and "docs" not in seg:  # a {docs} segment keeps the old reader's order
                    order = np.random.default_rng([self.seed, seg["epoch"], seg["shard"], seg["from"], j,
                                                   _DRAIN]).permutation(len(chunk))
                else:
                    order = np.arange(len(chunk))
                for i in range(taken, len(chunk)):
                    yield (k, j, i + 1), chunk[order[i]]
                taken = 0

    def _stream(self) -> Iterator[tuple[tuple, np.ndarray]]:
        """Documents in packing order, each with the position (epoch, shard, doc, taken, drain) just after it;
        drain is (pending segment, chunk offset, taken) while the pending work is drained, else None."""
        s = self.state
        epoch, shard, doc, taken = s["epoch"], s["shard"], s["doc"], s["taken"]
        if s.get("pending"):
            for drain, tokens in self._drain(*s["pending_pos"]):
                yield (epoch, shard, doc, taken, drain), tokens
        barren: set[int] = set()  # shards of the consecutive whole epochs that gave this reader nothing
        while True:
            fresh, seen = (shard, doc, taken) == (0, 0, 0), False
            docs = self._docs(epoch, shard, doc)
            while chunk := list(islice(docs, self.shuffle_buffer)):
                seen = True
                start = chunk[0][:2]
                if self.shuffle:
                    rng = np.random.default_rng([self.seed, epoch, self.reader, *start])
                    order = rng.permutation(len(chunk))
                else:
                    order = np.arange(len(chunk))
                for i in range(taken, len(chunk)):
                    yield (epoch, *start, i + 1, None), chunk[order[i]][2]
                taken = 0
            if seen:
                barren.clear()
            elif fresh:
                # An epoch whose shards are all unreadable is skipped: with shuffling, later epochs deal this
                # reader other shards. Fail only once that can no longer help: every shard has turned out
                # unreadable, or (no shuffle) the reader will be dealt the same shards forever.
                barren.update(epoch_shards(len(self.shards), epoch, self.seed, self.shuffle, self.reader,
                                           self.num_readers))
                if not self.shuffle or len(barren) == len(self.shards):
                    names = sorted(self.shards[i].name for i in barren)
                    raise RuntimeError(f"data: reader {self.reader} found no readable document in shards {names}")
            epoch, shard, doc, taken = epoch + 1, 0, 0, 0

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], dict]]:
        B, T = self.batch_size, self.seq_len
        eos = np.array([self.eos_id], dtype=np.int64)
        carry = np.asarray(self.state["carry"], dtype=np.int64)

        def drain(position: tuple):
            # B rows need B*T + 1 tokens: the last label is the first input of the next batch.
            nonlocal carry
            while len(carry) >= B * T + 1:
                batch = {
                    "input_ids": torch.from_numpy(carry[: B * T].reshape(B, T).copy()),  # [B, T]
                    "labels": torch.from_numpy(carry[1 : B * T + 1].reshape(B, T).copy()),  # [B, T]
                }
                carry = carry[B * T :]
                epoch, shard, doc, taken, pending_at = position
                # int32 halves what travels between processes; token ids never reach 2**31.
                state = {"epoch": epoch, "shard": shard, "doc": doc, "taken": taken,
                         "carry": carry.astype(np.int32), "skipped": sorted(self.skipped)}
                if pending_at is not None:  # the segment list stays in the main process (PackedLoader.__iter__)
                    state["pending_at"] = pending_at
                yield batch, state

        # A restored carry may already hold whole batches (a long document was being cut): they come out
        # before the next document is read, under the restored position, as they did in the original run.
        s = self.state
        at = (0, *s["pending_pos"]) if s.get("pending") else None
        yield from drain((s["epoch"], s["shard"], s["doc"], s["taken"], at))
        for position, tokens in self._stream():
            carry = np.concatenate([carry, tokens, eos])
            yield from drain(position)


class _ShardStream(IterableDataset):
    """What each DataLoader worker (or the main process) iterates: one reader's batches, tagged with its index."""

    def __init__(self, reader_kwargs: dict, rank: int, readers_per_rank: int, first: int, states: list[dict]):
        super().__init__()
        self.reader_kwargs, self.rank, self.readers_per_rank = reader_kwargs, rank, readers_per_rank
        self.first, self.states = first, states

    def __iter__(self):
        worker = get_worker_info()
        local = (self.first + (worker.id if worker is not None else 0)) % self.readers_per_rank
        reader = _Reader(reader=self.rank * self.readers_per_rank + local, state=self.states[local],
                         **self.reader_kwargs)
        for batch, state in reader:
            yield batch, local, state


def _as_is(sample):
    # Replaces DataLoader's default conversion, which would turn the state's numpy carry into a tensor.
    return sample


class PackedLoader:
    """Infinite iterable of {"input_ids", "labels"}: LongTensor [B, T] batches for one data-parallel rank.

    rank / world_size are the data-parallel coordinates: ranks that must see the same data (tensor or pipeline
    peers) pass the same rank. Each `iter()` starts from the current position (the one after the last batch
    handed out, or the one loaded); call `iter()` again after `load_state_dict`.
    """

    def __init__(self, path: str, *, seq_len: int, batch_size: int, eos_id: int, num_workers: int = 0,
                 seed: int = 0, shuffle: bool = True, shuffle_buffer: int = 64, rank: int = 0, world_size: int = 1,
                 pin_memory: bool = False):
        if not 0 <= rank < world_size:
            raise ValueError(f"data loader: rank {rank} outside world_size {world_size}")
        meta, shards = read_meta(path)
        self.readers_per_rank = max(1, num_workers)
        num_readers = world_size * self.readers_per_rank
        if len(shards) < num_readers:
            raise ValueError(
                f"data path {path!r} has {len(shards)} shards, fewer than world_size x max(1, num_workers) = "
                f"{num_readers} readers; re-run `python -m data.prepare` with a smaller --shard-size "
                "or lower data.num_workers"
            )
        self.path, self.rank, self.world_size = path, rank, world_size
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.seq_len, self.batch_size = seq_len, batch_size
        self.meta = meta
        self._reader_kwargs = dict(
            root=path, shards=shards, dtype=meta["ids_dtype"], num_readers=num_readers, seq_len=seq_len,
            batch_size=batch_size, seed=seed, shuffle=shuffle, shuffle_buffer=shuffle_buffer, eos_id=eos_id,
        )
        # What a saved position depends on; a resume that changes any of it could not replay the same tokens.
        # seq_len and batch_size are not in it: the position is in documents and tokens, so they may change.
        self._layout = {
            "num_readers": num_readers, "seed": seed, "shuffle": shuffle, "shuffle_buffer": shuffle_buffer,
            "eos_id": eos_id, "shards": hashlib.sha256("".join(s.sha256 for s in shards).encode()).hexdigest(),
        }
        self._states = [fresh_state() for _ in range(self.readers_per_rank)]
        self._first = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        given = list(self._states)
        dataset = _ShardStream(self._reader_kwargs, self.rank, self.readers_per_rank, self._first, given)
        loader = DataLoader(dataset, batch_size=None, num_workers=self.num_workers, collate_fn=_as_is,
                            pin_memory=self.pin_memory)
        for batch, local, state in loader:
            assert local == self._first, f"batch from reader {local}, expected {self._first} (round-robin broken)"
            at = state.pop("pending_at", None)
            if at is not None:  # still draining: keep the unfinished segments (indices relative to `given`)
                k, j, t = at
                state["pending"], state["pending_pos"] = given[local]["pending"][k:], [j, t]
            self._states[local] = state
            self._first = (local + 1) % self.readers_per_rank
            yield batch

    @property
    def skipped_shards(self) -> int:
        """Distinct shards skipped as unreadable so far, as reported by consumed batches."""
        return len(set().union(*(s["skipped"] for s in self._states)))

    @property
    def epoch(self) -> int:
        """The epoch of the slowest reader of this rank (readers advance independently; a reader draining the work
        left by an elastic resume is in the epoch of its first pending segment)."""
        return min(s["pending"][0]["epoch"] if s.get("pending") else s["epoch"] for s in self._states)

    def state_dict(self) -> dict:
        """Position after the last consumed batch, in plain Python types.

        Keyed by data-parallel rank: torch.distributed.checkpoint keeps one copy of equal keys across ranks,
        and every rank's position differs.
        """
        readers = [{**s, "carry": np.asarray(s["carry"]).tolist(), "skipped": list(s["skipped"])}
                   for s in self._states]
        return {f"dp_rank_{self.rank}": {"version": STATE_VERSION, **self._layout, "first": self._first,
                                         "readers": readers}}

    def resumes_exactly(self, state_dict: dict) -> bool:
        """Whether `state_dict` holds this rank's position saved under this very layout (same readers per rank,
        same number of readers, same data settings), which `load_state_dict` restores exactly from it alone.
        Otherwise a resume needs every saved data rank's state and `elastic=True`."""
        s = state_dict.get(f"dp_rank_{self.rank}")
        return (s is not None and s.get("version") in _LOADABLE_VERSIONS
                and all(s.get(name) == value for name, value in self._layout.items())
                and len(s["readers"]) == self.readers_per_rank)

    def load_state_dict(self, state_dict: dict, elastic: bool = False) -> None:
        """Restore a position. Saved under this layout: exactly (the same batches as an uninterrupted run). With
        `elastic=True` and the states of every saved data rank (`dp_rank_<d>` entries merged into one dict), also
        a position saved with another number of data ranks or data.num_workers (docs/data.md says how);
        without `elastic`, such a position is refused."""
        if elastic and not self.resumes_exactly(state_dict):
            self._load_elastic(state_dict)
            return
        key = f"dp_rank_{self.rank}"
        if key not in state_dict:
            raise ValueError(f"data loader state has no entry {key!r} (has {sorted(state_dict)}): "
                             "saved with a different data-parallel size?")
        s = state_dict[key]
        self._check(s, skip=())
        if len(s["readers"]) != self.readers_per_rank:
            raise ValueError(f"data loader state was saved with {len(s['readers'])} readers per rank, this loader has "
                             f"{self.readers_per_rank} (max(1, data.num_workers)); the saved position cannot be "
                             "replayed exactly")
        self._first = int(s["first"])
        self._states = [_restored(r) for r in s["readers"]]

    def _check(self, s: dict, skip: tuple[str, ...]) -> None:
        if s.get("version") not in _LOADABLE_VERSIONS:
            raise ValueError(f"data loader state version {s.get('version')!r}, expected one of {_LOADABLE_VERSIONS}")
        meaning = {"num_readers": " (world_size x max(1, data.num_workers))", "shards": " (hash of the shard list)"}
        for name, value in self._layout.items():
            if name not in skip and s[name] != value:
                raise ValueError(
                    f"data loader state was saved with {name}={s[name]!r}, this loader has {value!r}"
                    f"{meaning.get(name, '')}; the saved position cannot be replayed exactly"
                )

    def _load_elastic(self, state_dict: dict) -> None:
        entries = {k: v for k, v in state_dict.items() if k.startswith("dp_rank_")}
        if not entries:
            raise ValueError(f"data loader state has no dp_rank_<d> entry (has {sorted(state_dict)})")
        for s in entries.values():
            self._check(s, skip=("num_readers",))  # everything but the number of readers must match
        sizes = {(s["num_readers"], len(s["readers"])) for s in entries.values()}
        if len(sizes) != 1:
            raise ValueError(f"data loader states disagree on (num_readers, readers per rank): {sorted(sizes)}")
        ((old_readers, per_rank),) = sizes
        missing = [f"dp_rank_{d}" for d in range(old_readers // per_rank) if f"dp_rank_{d}" not in entries]
        if missing or old_readers % per_rank:
            raise ValueError(f"an elastic data resume needs the state of every saved data rank: {missing} missing "
                             f"(saved with {old_readers} readers, {per_rank} per rank)")
        old = [_restored(r) for d in range(old_readers // per_rank) for r in entries[f"dp_rank_{d}"]["readers"]]
        num_readers = self._layout["num_readers"]
        if old_readers == num_readers:  # the same readers, split otherwise over ranks x workers: each moves as it is
            new = old
            if self.rank == 0:
                log.info("data: resuming %d readers as %d ranks x %d (saved as %d x %d): each reader continues exactly",
                         num_readers, self.world_size, self.readers_per_rank, old_readers // per_rank, per_rank)
        else:
            kw = self._reader_kwargs
            new, plan = elastic_split(old, kw["shards"], num_readers=num_readers, seed=kw["seed"],
                                      shuffle=kw["shuffle"], shuffle_buffer=kw["shuffle_buffer"])
            if self.rank == 0:
                log.info("data: elastic resume from %d to %d readers: %d leftover documents of epochs <= %d and %d "
                         "carried tokens are read first, then epochs from %d", old_readers, num_readers,
                         plan["documents"], plan["last_epoch"], plan["carried_tokens"], plan["last_epoch"] + 1)
        R = self.readers_per_rank
        self._states = new[self.rank * R : (self.rank + 1) * R]
        self._first = 0


def _restored(r: dict) -> dict:
    """A saved reader state (plain types, from JSON or pickle) as the reader runs it."""
    out = {**fresh_state(), **{k: r[k] for k in ("epoch", "shard", "doc", "taken")},
           "skipped": list(r["skipped"]), "carry": np.asarray(r["carry"], dtype=np.int32)}
    if r.get("pending"):
        out["pending"] = [{**seg, "docs": [list(x) for x in seg["docs"]]} if "docs" in seg else dict(seg)
                          for seg in r["pending"]]
        out["pending_pos"] = [int(x) for x in r["pending_pos"]]
    return out


def _begun(s: dict) -> bool:
    """Whether a reader has packed a document of its current normal epoch."""
    return not s.get("pending") and (s["shard"], s["doc"], s["taken"]) != (0, 0, 0)


def _permutation(n: int, shuffle: bool, seed_seq: list[int]) -> np.ndarray:
    return np.random.default_rng(seed_seq).permutation(n) if shuffle else np.arange(n)


def _leftover(s: dict, reader: int, num_readers: int, shards: list[ShardInfo], *, seed: int, shuffle: bool,
              shuffle_buffer: int, last_epoch: int) -> list[dict]:
    """The segments old reader `reader` of `num_readers`, at state `s`, has left to read in epochs <= last_epoch."""
    skipped = set(s["skipped"])
    size = lambda i: 0 if shards[i].name in skipped else shards[i].num_docs  # noqa: E731 (as the reader saw it)
    out: list[dict] = []
    if s.get("pending"):  # its own drain: the rest of the current segment's chunk and segment, then the others
        first, (j, t) = s["pending"][0], s["pending_pos"]
        if "docs" in first:
            rest = [d for d in first["docs"] if shards[d[0]].name not in skipped][j + t:]
        else:
            lo = first["from"] + j
            hi = min(lo + shuffle_buffer, size(first["shard"]))
            order = _permutation(max(0, hi - lo), shuffle, [seed, first["epoch"], first["shard"], first["from"], j,
                                                            _DRAIN])
            rest = [[first["shard"], lo + int(i)] for i in order[t:]]
            if hi < size(first["shard"]):
                out.append({"epoch": first["epoch"], "shard": first["shard"], "from": hi})
        if rest:
            out.insert(0, {"epoch": first["epoch"], "docs": rest})
        out += s["pending"][1:]
    epoch = s["epoch"]
    if _begun(s):  # the rest of the chunk begun at (shard, doc), of its shard and of the epoch's shard list
        mine = epoch_shards(len(shards), epoch, seed, shuffle, reader, num_readers)
        pos, doc, chunk = s["shard"], s["doc"], []
        while pos < len(mine) and len(chunk) < shuffle_buffer:
            n = size(mine[pos])
            take = max(0, min(n - doc, shuffle_buffer - len(chunk)))
            chunk += [[mine[pos], i] for i in range(doc, doc + take)]
            doc += take
            if doc >= n:
                pos, doc = pos + 1, 0
        order = _permutation(len(chunk), shuffle, [seed, epoch, reader, s["shard"], s["doc"]])
        rest = [chunk[int(i)] for i in order[s["taken"]:]]
        if rest:
            out.append({"epoch": epoch, "docs": rest})
        if doc > 0:
            out.append({"epoch": epoch, "shard": mine[pos], "from": doc})
            pos += 1
        out += [{"epoch": epoch, "shard": i, "from": 0} for i in mine[pos:]]
        epoch += 1
    for e in range(epoch, last_epoch + 1):  # epochs it has not begun, up to the last any reader has begun
        out += [{"epoch": e, "shard": i, "from": 0}
                for i in epoch_shards(len(shards), e, seed, shuffle, reader, num_readers)]
    return out


def elastic_split(old: list[dict], shards: list[ShardInfo], *, num_readers: int, seed: int, shuffle: bool,
                  shuffle_buffer: int) -> tuple[list[dict], dict]:
    """New states for `num_readers` readers that together read exactly what the old readers (states `old`, indexed
    by global reader) have left, then go on with epoch e_max + 1 split over the new readers (docs/data.md).

    Returns (states, {"last_epoch": e_max, "documents": leftover documents, "carried_tokens": ...})."""
    last = max((s["epoch"] if _begun(s) else s["epoch"] - 1) for s in old)
    kw = dict(seed=seed, shuffle=shuffle, shuffle_buffer=shuffle_buffer, last_epoch=last)
    segments = [(seg["epoch"], r, i, seg) for r, s in enumerate(old)
                for i, seg in enumerate(_leftover(s, r, len(old), shards, **kw))]
    segments.sort(key=lambda x: x[:3])
    skipped = set().union(*(s["skipped"] for s in old))

    def docs(seg: dict) -> int:
        if "docs" in seg:
            return len(seg["docs"])
        return 0 if shards[seg["shard"]].name in skipped else max(0, shards[seg["shard"]].num_docs - seg["from"])

    heap = [(0, g) for g in range(num_readers)]  # (leftover documents dealt so far, new reader)
    dealt: list[list[dict]] = [[] for _ in range(num_readers)]
    for *_, seg in segments:
        load, g = heapq.heappop(heap)
        dealt[g].append(seg)
        heapq.heappush(heap, (load + docs(seg), g))
    new = []
    for g in range(num_readers):
        mine = old[g::num_readers]  # carries and skipped names of old readers g, g + G', ...
        state = {**fresh_state(), "epoch": last + 1, "skipped": sorted(set().union(*(s["skipped"] for s in mine))),
                 "carry": np.concatenate([np.asarray(s["carry"], dtype=np.int32) for s in mine]
                                         + [np.zeros(0, np.int32)])}
        if dealt[g]:
            state["pending"], state["pending_pos"] = dealt[g], [0, 0]
        new.append(state)
    plan = {"last_epoch": last, "documents": sum(docs(seg) for *_, seg in segments),
            "carried_tokens": int(sum(len(s["carry"]) for s in old))}
    return new, plan
