"""SFT data: chat samples encoded by the chat template (data/chat.py) into length-bucketed batches whose labels are
the assistant tokens only.

Contract: `SFTLoader(samples_or_source, ...)` is an infinite iterable of {"input_ids", "labels"} [B, T] for one data
rank, one sample per row (no packing), right-padded (input pad_id, label IGNORE_INDEX), labels the next token where
it is an assistant token; T is the batch's longest row rounded up to `pad_multiple` (at most seq_len), or seq_len
with `fixed_length`. Sources (`load_samples`, `source_files`): JSONL files, webdataset tar shards of `<key>.json`
members, globs, directories, lists of these, or in-memory sample dicts. Malformed samples are skipped and counted
by reason (`stats["skipped"]`); over-long samples are truncated (`stats["truncated"]`). Every data rank yields the
same number of batches per epoch (`batches_per_epoch`); `state_dict()` / `load_state_dict()` resume exactly on the
same samples and layout (others are refused).

Design and reasoning: docs/data.md#sft-batches
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import os
import tarfile
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from data.chat import MAX_EFFORT, ChatTemplate, check_sample

__all__ = ["IGNORE_INDEX", "SFTLoader", "load_samples", "measure_padding", "split_samples"]

IGNORE_INDEX = -100
"""a label that takes no part in the loss; trainer.loss.IGNORE_INDEX (data/ does not import the trainer; the tests
check that the two agree)"""

STATE_VERSION = 1
BAD_JSON = "not valid JSON"
NO_JSON_MEMBER = "tar sample without a json member"
UNREADABLE_SHARD = "unreadable tar shard (rest of it skipped)"
PROMPT_TOO_LONG = "prompt longer than seq_len"
_JSONL_SUFFIXES = (".jsonl",)
_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")

Source = str | os.PathLike | Sequence[str | os.PathLike]


# -- reading -----------------------------------------------------------------------------------------------------------

def source_files(source: Source) -> list[str]:
    """The JSONL and tar files a source names: a file, a glob, a directory (recursively) or a list of these."""
    entries = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    files: list[str] = []
    for entry in map(os.fspath, entries):
        if os.path.isdir(entry):
            root = Path(entry)
            found = sorted(str(p) for p in root.rglob("*") if p.is_file() and _kind(str(p))
                           and not any(part.startswith(".") for part in p.relative_to(root).parts))
            if not found:
                raise FileNotFoundError(f"SFT source directory {entry!r} holds no .jsonl or .tar file")
        elif os.path.isfile(entry):
            if not _kind(entry):
                raise ValueError(f"SFT source {entry!r} is neither JSONL ({_JSONL_SUFFIXES}) nor tar ({_TAR_SUFFIXES})")
            found = [entry]
        elif globlib.has_magic(entry):
            found = sorted(p for p in globlib.glob(entry, recursive=True) if os.path.isfile(p) and _kind(p))
            if not found:
                raise FileNotFoundError(f"SFT source glob {entry!r} matches no .jsonl or .tar file")
        else:
            raise FileNotFoundError(f"SFT source {entry!r} does not exist")
        files += found
    return files


def _kind(path: str) -> str | None:
    if path.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if path.endswith(_TAR_SUFFIXES):
        return "tar"
    return None


def _parse(payload: bytes) -> object | None:
    try:
        return json.loads(payload)
    except ValueError:  # UnicodeDecodeError included
        return None


def _read_jsonl(path: str) -> Iterator[tuple[str, object, str | None]]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = _parse(line)
            yield f"{path}:{lineno}", obj, BAD_JSON if obj is None else None


def _read_tar(path: str) -> Iterator[tuple[str, object, str | None]]:
    """Samples of a webdataset shard: consecutive members sharing a key (the name up to the first dot of its base
    name, as webdataset splits it) are one sample; its `json` member is the sample."""
    key, payload = None, None

    def sample() -> tuple[str, object, str | None]:
        obj = None if payload is None else _parse(payload)
        reason = NO_JSON_MEMBER if payload is None else BAD_JSON if obj is None else None
        return f"{path}:{key}", obj, reason

    try:
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                head, base = os.path.split(member.name)
                stem, dot, ext = base.partition(".")
                if not dot or not stem:
                    continue  # not a webdataset member (no key or no extension)
                name = os.path.join(head, stem)
                if name != key:
                    if key is not None:
                        yield sample()
                    key, payload = name, None
                if ext == "json":
                    payload = tar.extractfile(member).read()
    except (tarfile.TarError, EOFError, OSError):
        yield f"{path}:{key or 'start'}", None, UNREADABLE_SHARD
        return
    if key is not None:
        yield sample()


def _read(source: Source) -> Iterator[tuple[str, object, str | None]]:
    """(where, object, reason it cannot be used) for every sample of `source`, in order."""
    for path in source_files(source):
        yield from (_read_jsonl if _kind(path) == "jsonl" else _read_tar)(path)


class _Skipped:
    """Skipped samples counted by reason, with the first offender of each, warned about once per reason."""

    def __init__(self, counts: dict[str, int] | None = None):
        self.counts: Counter[str] = Counter(counts or {})
        self.first: dict[str, str] = {}

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] += 1
        self.first.setdefault(reason, where)

    def warn(self) -> None:
        for reason, where in self.first.items():
            n = self.counts[reason]
            warnings.warn(f"data.sft: skipped {n} sample{'s' * (n != 1)}: {reason} (first: {where})",
                          RuntimeWarning, stacklevel=3)


def load_samples(source: Source) -> tuple[list[dict], dict[str, int]]:
    """(the samples of `source` that parse, {reason: count} of those that do not); warns once per reason.

    For splitting a source before building loaders (`split_samples`); pass the counts on as SFTLoader's `skipped`
    so its stats are complete. Schema checks happen in SFTLoader, which also takes in-memory samples.
    """
    samples, skipped = [], _Skipped()
    for where, obj, reason in _read(source):
        if reason is None:
            samples.append(obj)
        else:
            skipped.add(reason, where)
    skipped.warn()
    return samples, dict(skipped.counts)


def split_samples(samples: Sequence, held_out: float | int, seed: int = 0) -> tuple[list, list]:
    """(train, held) of `samples`: `held_out` is a fraction in [0, 1) or a count; a seeded choice, both parts keeping
    the input order. A non-zero fraction holds out at least one sample."""
    n = len(samples)
    if isinstance(held_out, float):
        if not 0.0 <= held_out < 1.0:
            raise ValueError(f"held_out as a fraction must be in [0, 1), got {held_out}")
        k = max(1, round(n * held_out)) if held_out > 0 and n > 1 else 0
    elif isinstance(held_out, int) and not isinstance(held_out, bool):
        if not 0 <= held_out <= n:
            raise ValueError(f"held_out as a count must be in 0..{n} (the number of samples), got {held_out}")
        k = held_out
    else:
        raise ValueError(f"held_out must be a float fraction or an int count, got {held_out!r}")
    held = np.zeros(n, dtype=bool)
    held[np.random.default_rng([seed, 0x5EED]).permutation(n)[:k]] = True
    return [s for s, h in zip(samples, held) if not h], [s for s, h in zip(samples, held) if h]


# -- the plan of an epoch ----------------------------------------------------------------------------------------------

def _epoch_steps(lengths: np.ndarray, epoch: int, seed: int, step_size: int, bucket_size: int,
                 sort: bool = True) -> list[np.ndarray]:
    """The steps of `epoch`, in order: each an array of step_size sample indices (rank r takes [r*B : (r+1)*B])."""
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    steps = []
    for start in range(0, len(order), bucket_size):
        bucket = order[start : start + bucket_size]
        if sort:
            bucket = bucket[np.argsort(lengths[bucket], kind="stable")]
        steps += [bucket[i : i + step_size] for i in range(0, len(bucket) - step_size + 1, step_size)]
    return [steps[i] for i in rng.permutation(len(steps))]


def _batch_len(row_lengths: np.ndarray, seq_len: int, pad_multiple: int, fixed_length: bool) -> int:
    if fixed_length:
        return seq_len
    longest = int(row_lengths.max())
    return min(seq_len, -(-longest // pad_multiple) * pad_multiple)


# -- the loader --------------------------------------------------------------------------------------------------------

class SFTLoader:
    """Infinite iterable of {"input_ids": LongTensor[B, T], "labels": LongTensor[B, T]} for one data rank.

    samples_or_source: a list of sample dicts, or a source (file, glob, directory, list of them; docs/data.md).
    template: the ChatTemplate that encodes the samples (its pad_id pads).
    seq_len: the most positions of a row (longer samples are truncated, see docs/data.md#sft-batches).
    batch_size: rows per batch B on each data rank.
    data_rank / data_ranks: this rank's share; peers that must see the same batches (tensor / pipeline / context
        parallel) pass the same data_rank.
    seed: seeds every epoch's permutation.
    bucket_size: samples sorted together by length; rounded down to a multiple of data_ranks x batch_size (at least
        one step); None = 64 steps' worth.
    pad_multiple: a batch's T is rounded up to a multiple of this (kernel-friendly shapes), at most seq_len.
    fixed_length: pad every batch to T = seq_len.
    default_effort: the effort of samples without an "effort" field.
    skipped: {reason: count} of samples dropped before this loader (load_samples' counts), added to stats.
    """

    def __init__(self, samples_or_source: Source | Sequence[dict], template: ChatTemplate, *, seq_len: int,
                 batch_size: int, data_rank: int = 0, data_ranks: int = 1, seed: int = 0,
                 bucket_size: int | None = None, pad_multiple: int = 8, fixed_length: bool = False,
                 default_effort: int = MAX_EFFORT, skipped: dict[str, int] | None = None):
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("data_ranks", data_ranks),
                            ("pad_multiple", pad_multiple)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= data_rank < data_ranks:
            raise ValueError(f"data_rank must be in 0..{data_ranks - 1}, got {data_rank}")
        self.template = template
        self.seq_len, self.batch_size = seq_len, batch_size
        self.data_rank, self.data_ranks, self.seed = data_rank, data_ranks, seed
        self.pad_multiple, self.fixed_length = pad_multiple, fixed_length
        self._step_size = data_ranks * batch_size
        bucket = 64 * self._step_size if bucket_size is None else bucket_size
        if bucket <= 0:
            raise ValueError(f"bucket_size must be positive, got {bucket_size}")
        self.bucket_size = max(1, bucket // self._step_size) * self._step_size

        if isinstance(samples_or_source, (str, os.PathLike)) or (
            isinstance(samples_or_source, Sequence) and samples_or_source
            and all(isinstance(s, (str, os.PathLike)) for s in samples_or_source)
        ):
            items = _read(samples_or_source)
        else:
            items = ((f"sample {i}", s, None) for i, s in enumerate(samples_or_source))
        self._skipped = _Skipped(skipped)
        self._inputs, self._labels, self._truncated = self._encode(items, default_effort)
        self._skipped.warn()
        if self._truncated:
            n = self._truncated
            warnings.warn(f"data.sft: truncated {n} sample{'s' * (n != 1)} to seq_len={seq_len} positions",
                          RuntimeWarning, stacklevel=2)
        self._lengths = np.array([len(x) for x in self._inputs], dtype=np.int64)
        if len(self._lengths) < self._step_size:
            raise ValueError(
                f"SFT data has {len(self._lengths)} usable samples (skipped: {dict(self._skipped.counts)}), fewer "
                f"than one step takes (batch_size {batch_size} x {data_ranks} data ranks)")
        self._fingerprint = self._digest()
        self._epoch = self._step = 0
        self._plan: tuple[int, list[np.ndarray]] | None = None
        self._counts = {"batches": 0, "positions": 0, "padding": 0, "loss_tokens": 0}

    def _encode(self, items, default_effort: int) -> tuple[list[np.ndarray], list[np.ndarray], int]:
        inputs, labels, truncated = [], [], 0
        for where, obj, reason in items:
            reason = reason or check_sample(obj)
            if reason is not None:
                self._skipped.add(reason, where)
                continue
            ids, mask = self.template.encode(obj["messages"], obj.get("effort", default_effort))
            if len(ids) - 1 > self.seq_len:
                ids, mask = ids[: self.seq_len + 1], mask[: self.seq_len + 1]
                if not any(mask[1:]):
                    self._skipped.add(PROMPT_TOO_LONG, where)
                    continue
                truncated += 1
            x = np.asarray(ids, dtype=np.int32)  # half the memory of int64; ids never reach 2**31
            inputs.append(x[:-1])
            labels.append(np.where(np.asarray(mask[1:]), x[1:], np.int32(IGNORE_INDEX)))
        return inputs, labels, truncated

    def _digest(self) -> str:
        """Identifies the encoded samples and the layout a saved position belongs to."""
        h = hashlib.sha256(json.dumps([self.seq_len, self._step_size, self.bucket_size, self.seed]).encode())
        h.update(self._lengths.tobytes())
        for x, y in zip(self._inputs, self._labels):
            h.update(x.tobytes())
            h.update(y.tobytes())
        return h.hexdigest()

    # -- iteration --------------------------------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        return len(self._lengths)

    @property
    def batches_per_epoch(self) -> int:
        """batches every data rank yields per epoch (the same on every rank)"""
        full, rest = divmod(self.num_samples, self.bucket_size)
        return full * (self.bucket_size // self._step_size) + rest // self._step_size

    def _steps(self, epoch: int) -> list[np.ndarray]:
        if self._plan is None or self._plan[0] != epoch:
            self._plan = (epoch, _epoch_steps(self._lengths, epoch, self.seed, self._step_size, self.bucket_size))
        return self._plan[1]

    def _collate(self, rows: np.ndarray) -> dict[str, torch.Tensor]:
        B, T = len(rows), _batch_len(self._lengths[rows], self.seq_len, self.pad_multiple, self.fixed_length)
        input_ids = np.full((B, T), self.template.pad_id, dtype=np.int64)  # [B, T]
        labels = np.full((B, T), IGNORE_INDEX, dtype=np.int64)  # [B, T]
        for b, i in enumerate(rows):
            n = self._lengths[i]
            input_ids[b, :n], labels[b, :n] = self._inputs[i], self._labels[i]
        c = self._counts
        c["batches"] += 1
        c["positions"] += B * T
        c["padding"] += B * T - int(self._lengths[rows].sum())
        c["loss_tokens"] += int((labels != IGNORE_INDEX).sum())
        return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels)}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """Batches from the current position on, forever. One iterator at a time: they share the position."""
        B, r = self.batch_size, self.data_rank
        while True:
            steps = self._steps(self._epoch)
            while self._step < len(steps):
                rows = steps[self._step][r * B : (r + 1) * B]
                self._step += 1  # before the yield: state_dict() taken after a batch points past it
                yield self._collate(rows)
            self._epoch, self._step = self._epoch + 1, 0

    # -- position and statistics ------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The position after the last batch handed out, as plain types."""
        return {"version": STATE_VERSION, "epoch": self._epoch, "step": self._step,
                "fingerprint": self._fingerprint, "counts": dict(self._counts)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"SFT loader state has version {state.get('version')!r}, expected {STATE_VERSION}")
        if state["fingerprint"] != self._fingerprint:
            raise ValueError(
                "SFT loader state was saved over other samples or another layout (seq_len, data_ranks x batch_size, "
                "bucket_size, seed): its position means nothing here")
        self._epoch, self._step = int(state["epoch"]), int(state["step"])
        self._counts = {k: int(v) for k, v in state["counts"].items()}

    @property
    def stats(self) -> dict:
        """samples (used), skipped {reason: count}, truncated, and over the batches yielded so far: batches,
        padding_share (pad positions / positions) and assistant_share (loss labels / positions)"""
        c = self._counts
        positions = max(1, c["positions"])  # 0 / 1 = 0.0 before the first batch
        return {"samples": self.num_samples, "skipped": dict(self._skipped.counts), "truncated": self._truncated,
                "batches": c["batches"], "padding_share": c["padding"] / positions,
                "assistant_share": c["loss_tokens"] / positions}


def measure_padding(samples: Source | Sequence[dict], template: ChatTemplate, seq_len: int, batch_size: int, *,
                    pad_multiple: int = 8, bucket_size: int | None = None, seed: int = 0) -> dict[str, float]:
    """Padding share (pad positions / positions) of one epoch of batches of `samples` under three rules:
    "bucketed" (SFTLoader's), "random" (the same permutation cut into batches without sorting) and "fixed_length"
    (bucketed, every batch padded to seq_len). One data rank; the shares do not depend on how many there are."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the loader's skip warnings are not what is measured
        loader = SFTLoader(samples, template, seq_len=seq_len, batch_size=batch_size, seed=seed,
                           bucket_size=bucket_size, pad_multiple=pad_multiple)
    lengths = loader._lengths

    def share(sort: bool, fixed: bool) -> float:
        steps = _epoch_steps(lengths, 0, seed, batch_size, loader.bucket_size, sort=sort)
        positions = sum(len(s) * _batch_len(lengths[s], seq_len, pad_multiple, fixed) for s in steps)
        return 1.0 - sum(int(lengths[s].sum()) for s in steps) / positions

    return {"bucketed": share(True, False), "random": share(False, False), "fixed_length": share(True, True)}
