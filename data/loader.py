"""Reading prepared shards: split over ranks and workers, shuffled, packed into windows, resumable.

Shape legend: B rows per batch (data.batch_size), T tokens per row (data.seq_len).

Who reads what. Each rank runs R = max(1, num_workers) readers: one per DataLoader worker, or one in the main
process when num_workers = 0. Reader g = rank * R + local index, of G = world_size * R. In epoch e the shard
list is permuted by a generator seeded with (seed, e), the same permutation everywhere, and reader g takes
positions g, g + G, g + 2G, ... of it: each shard is read by exactly one reader per epoch (no overlap, no loss).
When G does not divide the number of shards S, readers hold floor(S/G) or ceil(S/G) shards (and shards differ
in length anyway), so they reach the end of an epoch at different times. Nothing waits for that: each reader's
stream is infinite and moves on to its own next epoch, so every rank always has a next batch and all ranks
run the same number of steps. The epoch counter is therefore per reader. S < G is refused at construction:
a reader without a shard would never yield.

Shuffling (data.shuffle): the per-epoch shard permutation above, plus a buffer shuffle: a reader takes its
documents in chunks of `shuffle_buffer` consecutive documents and permutes each chunk with a generator seeded by
(seed, epoch, reader, chunk start). A chunk is recomputable from its start, which keeps the saved position small.

Packing. Every document is followed by <eos> and appended to the reader's token stream. Rows are windows of
T + 1 tokens starting every T tokens (neighbouring rows overlap by one token); input_ids = window[:-1] and
labels = window[1:], so each token of the stream except the first is a label exactly once. A document is cut
wherever a window ends and its rest carries into the next row, the next batch, the next epoch: nothing is
padded or dropped. Attention is not masked at document boundaries; the <eos> marks them.

Position. A reader's state is {epoch, start of its current chunk (shard position, document index), documents
of that chunk already packed, the carried tokens, shards skipped}. Each batch travels from its worker with the
state its reader had right after making it; the loader keeps the state of the last batch it handed out per
reader, plus which reader hands out the next batch (DataLoader collects from workers round-robin, so batch n
comes from reader (first + n) mod R; a restored loader runs reader (first + j) mod R in worker slot j). Prefetched
batches are not part of the state, so a resumed loader yields exactly the batches an uninterrupted one would.

Unreadable shards (bad checksum, bad tar, wrong counts) are skipped with a warning naming them; the number of
distinct shards this rank's readers skipped is `PackedLoader.skipped_shards` (per rank: other ranks read other
shards). A reader whose whole epoch is unreadable moves on to its next epoch; it raises only once every shard
has proved unreadable, or at once without shuffling (it would be dealt the same shards forever).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Iterator
from itertools import islice

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data.shards import ShardError, ShardInfo, read_meta, read_shard

STATE_VERSION = 1


def fresh_state() -> dict:
    return {"epoch": 0, "shard": 0, "doc": 0, "taken": 0, "carry": [], "skipped": []}


def epoch_shards(num_shards: int, epoch: int, seed: int, shuffle: bool, reader: int, num_readers: int) -> list[int]:
    """Indices (into meta.json's shard list) that `reader` of `num_readers` reads in `epoch`, in order."""
    order = np.random.default_rng([seed, epoch]).permutation(num_shards) if shuffle else np.arange(num_shards)
    return order[reader::num_readers].tolist()


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

    def _stream(self) -> Iterator[tuple[tuple[int, int, int, int], np.ndarray]]:
        """Documents in packing order, each with the position (epoch, shard, doc, taken) just after it."""
        s = self.state
        epoch, shard, doc, taken = s["epoch"], s["shard"], s["doc"], s["taken"]
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
                    yield (epoch, *start, i + 1), chunk[order[i]][2]
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

        def drain(position: tuple[int, int, int, int]):
            # B rows need B*T + 1 tokens: the last label is the first input of the next batch.
            nonlocal carry
            while len(carry) >= B * T + 1:
                batch = {
                    "input_ids": torch.from_numpy(carry[: B * T].reshape(B, T).copy()),  # [B, T]
                    "labels": torch.from_numpy(carry[1 : B * T + 1].reshape(B, T).copy()),  # [B, T]
                }
                carry = carry[B * T :]
                epoch, shard, doc, taken = position
                # int32 halves what travels between processes; token ids never reach 2**31.
                yield batch, {"epoch": epoch, "shard": shard, "doc": doc, "taken": taken,
                              "carry": carry.astype(np.int32), "skipped": sorted(self.skipped)}

        # A restored carry may already hold whole batches (a long document was being cut): they come out
        # before the next document is read, under the restored position, as they did in the original run.
        yield from drain(tuple(self.state[k] for k in ("epoch", "shard", "doc", "taken")))
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
        dataset = _ShardStream(self._reader_kwargs, self.rank, self.readers_per_rank, self._first,
                               list(self._states))
        loader = DataLoader(dataset, batch_size=None, num_workers=self.num_workers, collate_fn=_as_is,
                            pin_memory=self.pin_memory)
        for batch, local, state in loader:
            assert local == self._first, f"batch from reader {local}, expected {self._first} (round-robin broken)"
            self._states[local] = state
            self._first = (local + 1) % self.readers_per_rank
            yield batch

    @property
    def skipped_shards(self) -> int:
        """Distinct shards skipped as unreadable so far, as reported by consumed batches."""
        return len(set().union(*(s["skipped"] for s in self._states)))

    @property
    def epoch(self) -> int:
        """The epoch of the slowest reader of this rank (readers advance independently)."""
        return min(s["epoch"] for s in self._states)

    def state_dict(self) -> dict:
        """Position after the last consumed batch, in plain Python types.

        Keyed by data-parallel rank: torch.distributed.checkpoint keeps one copy of equal keys across ranks,
        and every rank's position differs.
        """
        readers = [{**s, "carry": np.asarray(s["carry"]).tolist(), "skipped": list(s["skipped"])}
                   for s in self._states]
        return {f"dp_rank_{self.rank}": {"version": STATE_VERSION, **self._layout, "first": self._first,
                                         "readers": readers}}

    def load_state_dict(self, state_dict: dict) -> None:
        key = f"dp_rank_{self.rank}"
        if key not in state_dict:
            raise ValueError(f"data loader state has no entry {key!r} (has {sorted(state_dict)}): "
                             "saved with a different data-parallel size?")
        s = state_dict[key]
        if s.get("version") != STATE_VERSION:
            raise ValueError(f"data loader state version {s.get('version')!r}, expected {STATE_VERSION}")
        meaning = {"num_readers": " (world_size x max(1, data.num_workers))", "shards": " (hash of the shard list)"}
        for name, value in self._layout.items():
            if s[name] != value:
                raise ValueError(
                    f"data loader state was saved with {name}={s[name]!r}, this loader has {value!r}"
                    f"{meaning.get(name, '')}; the saved position cannot be replayed exactly"
                )
        self._first = int(s["first"])
        self._states = [
            {**fresh_state(), **{k: r[k] for k in ("epoch", "shard", "doc", "taken", "skipped")},
             "carry": np.asarray(r["carry"], dtype=np.int32)}
            for r in s["readers"]
        ]
