"""Checkpoints with torch.distributed.checkpoint (DCP): atomic, keep-last-k, resumable, and resharded on load.

Contract: `Checkpointer` saves `<run dir>/checkpoints/step_<N>/` with two Stateful entries, `train` (`TrainState`:
model, optimiser, LR scheduler, step and tokens seen, keyed by the whole model's names under every layout, so any
other layout loads it) and `rank_local` (`RankLocalState`: data-loader positions and RNG states), plus a `COMPLETE`
marker written last (format, step, model and parallel config, every file's size and sha256). Only a `step_<N>`
directory with the marker is a checkpoint. A failed save raises `CheckpointSaveError` and leaves the previous one
newest; `checkpoint.resume=auto` verifies the newest complete checkpoint and falls back past a corrupt one
(`CorruptCheckpoint`); a model config that differs fails before anything is built (`check_model`), naming every key.
Format 1 checkpoints stay loadable.

Design and reasoning: docs/checkpoints.md#dcp-checkpoints
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import pickle
import random
import re
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from data.shards import file_sha256
from trainer.config import CheckpointConfig

log = logging.getLogger(__name__)


class CheckpointSaveError(RuntimeError):
    """A save that could not complete; its partial files are removed and the previous checkpoint stays."""


class CorruptCheckpoint(ValueError):
    """A checkpoint whose files do not match the checksums its marker recorded."""

COMPLETE_MARKER = "COMPLETE"
CHECKPOINT_FORMAT = 2  # bump when the layout of the Stateful entries changes; keep older formats loadable
# Model config keys that change no parameter's name, shape or dtype: a resume may change them (switches of
# post-training hooks, kernels, balancing rates, the initialisation that a checkpoint overrides anyway). `vision.` is
# not among them: the backbone builds the tower (Transformer.vision), so its sizes are parameter shapes; a checkpoint
# older than the `vision` section still resumes (`model_config_differences` skips keys the saved config lacks).
RESUMABLE_MODEL_KEYS = ("name", "init_std", "kernels", "image_token_id", "mhc.impl", "indexer.", "quant.",
                        "moe.bias_update_rate", "moe.seq_aux_loss_coef", "csa2.hierarchical_pool")
_STEP_DIR = re.compile(r"^step_(\d+)$")


PIECE_BYTES = 256 * 2**20  # the largest tensor piece a checkpoint stores as one item


def row_ranges(shape, itemsize: int, max_bytes: int, multiple: int = 1) -> list[tuple[int, int]]:
    """Row ranges [start, stop) of dim 0 that split a tensor of `shape` into pieces of at most max_bytes (at least
    `multiple` rows each, every start a multiple of `multiple`); [(0, 1)] for a 0-d tensor."""
    if not len(shape):
        return [(0, 1)]
    row = math.prod(shape[1:]) * itemsize
    step = max(multiple, max_bytes // max(row, 1) // multiple * multiple)
    return [(a, min(a + step, shape[0])) for a in range(0, shape[0], step)]


class PieceSavePlanner(DefaultSavePlanner):
    """DCP's default save plan with every tensor item above `piece_bytes` split into row ranges (dim 0) of at most
    that size. DCP reads a stored item whole before it narrows it to what a load asks for, so pieces bound the host
    memory of any partial read: a resharded resume, the Hugging Face export (trainer/checkpoint/hf_io.py), which reads
    a tensor a piece at a time. A piece is written as its own copy (DCP clones a view before writing it), so saving
    holds at most a piece more than the tensors themselves. The checkpoint's metadata lists a tensor's pieces as its
    chunks, as it lists a sharded tensor's shards; every layout loads it."""

    def __init__(self, piece_bytes: int = PIECE_BYTES) -> None:
        super().__init__()
        self.piece_bytes = piece_bytes
        self._whole: dict = {}  # a piece's index -> (the whole item, its first row, its rows)

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            td = item.tensor_data
            if td is None or not len(td.chunk.sizes) or td.chunk.sizes[0] < 2:
                items.append(item)
                continue
            sizes = list(td.chunk.sizes)
            ranges = row_ranges(sizes, td.properties.dtype.itemsize, self.piece_bytes)
            if len(ranges) == 1:
                items.append(item)
                continue
            for a, b in ranges:
                rows = b - a
                offsets = torch.Size([td.chunk.offsets[0] + a, *td.chunk.offsets[1:]])
                chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([rows, *sizes[1:]]))
                piece = dataclasses.replace(item, index=dataclasses.replace(item.index, offset=offsets, index=None),
                                            type=WriteItemType.SHARD,
                                            tensor_data=dataclasses.replace(td, chunk=chunk))
                self._whole[piece.index] = (item, a, rows)
                items.append(piece)
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item):
        whole = self._whole.get(write_item.index)
        if whole is None:
            return super().resolve_data(write_item)
        item, a, rows = whole
        return super().resolve_data(item).narrow(0, a, rows)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    return _STEP_DIR.match(path.name) is not None and (path / COMPLETE_MARKER).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


class TrainState:
    """Stateful: model, optimiser, scheduler and counters, loaded in that order (the scheduler sets the
    lr from its step count after the optimiser restored its param groups)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        # An optimiser whose param groups differ between layouts (optim.rules: a pipeline stage holds only some
        # rules' parameters) saves each parameter's hyperparameters under its name, not under a group's position:
        # the checkpoint then loads into any layout's groups. AdamW alone keeps torch's default (its two groups).
        self.optim_options = (StateDictOptions(flatten_optimizer_state_dict=True)
                              if getattr(optimizer, "groups_vary_by_layout", False) else None)
        self.step = 0
        self.tokens_seen = 0
        self.skipped_steps = 0  # steps whose loss or gradient norm was not finite (no update); kept in the marker
        self.loaded_hyperparameters: list[dict] = []  # the checkpoint's param-group hyperparameters, after a load

    def state_dict(self) -> dict:
        return {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self.optimizer, options=self.optim_options),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "tokens_seen": self.tokens_seen,
        }

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state["model"])
        # The param groups' hyperparameters (lr, betas, eps, weight decay, `foreach`) are the config's: a resume with
        # optim.lr=1e-3 over a run trained at 3e-3 trains at 1e-3 (torch's load_state_dict would restore the
        # checkpoint's). Only the state (moments, step counts) comes from the checkpoint. The scheduler loads after
        # this, so it scales the config's initial_lr.
        live = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"], options=self.optim_options)
        self.loaded_hyperparameters = [{k: v for k, v in g.items() if k != "params"}
                                       for g in self.optimizer.param_groups]
        for group, values in zip(self.optimizer.param_groups, live):
            group.update(values)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RankLocalState:
    """Stateful: this rank's data position (shared by the peers that read the same data) and RNG states, each
    pickled to one opaque blob so that DCP neither flattens them nor mixes two ranks' states.

    `keys_in_checkpoint` (set by Checkpointer.load) lets a load ask only for what the checkpoint has: the RNG of a
    rank the saving run did not have is skipped. A loader with `resumes_exactly` (PackedLoader) whose own saved
    position is missing or from another layout gets every saved data rank's position instead, read from
    `checkpoint_path` on this rank alone, and resumes elastically; for any other loader a missing data position is
    an error naming the layouts."""

    def __init__(self, loader, rank: int, data_rank: int | None = None) -> None:
        self.loader, self.rank = loader, rank
        self.data_rank = rank if data_rank is None else data_rank
        self.keys_in_checkpoint: set[str] | None = None  # None: saving, or everything is there
        self.checkpoint_path: tuple[Path, str] | None = None  # (directory, this entry's name) while loading

    @property
    def data_key(self) -> str:
        return f"data_rank{self.data_rank}"

    @property
    def rng_key(self) -> str:
        return f"rng_rank{self.rank}"

    @property
    def key(self) -> str:  # format 1: data position and RNG in one blob per rank
        return f"rank{self.rank}"

    def state_dict(self) -> dict:
        keys = self.keys_in_checkpoint
        if keys is not None and self.data_key not in keys and self.key in keys:  # format 1
            return {self.key: b""}
        out = {self.data_key: pickle.dumps(self.loader.state_dict()), self.rng_key: pickle.dumps(_rng_state())}
        return out if keys is None else {k: v for k, v in out.items() if k in keys}

    def _all_data_positions(self) -> dict:
        """Every saved data rank's loader state, merged ({dp_rank_<d>: ...}), read by this rank alone."""
        path, name = self.checkpoint_path
        keys = sorted(k for k in (self.keys_in_checkpoint or ()) if k.startswith("data_rank"))
        if not keys:
            raise ValueError(f"checkpoint {path} has no data position")
        blobs = {name: {k: b"" for k in keys}}
        dcp.load(blobs, storage_reader=FileSystemReader(str(path)), no_dist=True)
        merged: dict = {}
        for k in keys:
            merged.update(pickle.loads(blobs[name][k]))
        return merged

    def load_state_dict(self, state: dict) -> None:
        if self.key in state:  # format 1
            blob = pickle.loads(state[self.key])
            self.loader.load_state_dict(blob["data"])
            _set_rng_state(blob["rng"])
            return
        own = pickle.loads(state[self.data_key]) if self.data_key in state else None
        exact = getattr(self.loader, "resumes_exactly", None)
        if exact is not None and self.checkpoint_path is not None and (own is None or not exact(own)):
            try:
                self.loader.load_state_dict(self._all_data_positions(), elastic=True)
            except ValueError as e:
                raise ValueError(f"cannot resume the data position: {e}. Resume with the checkpoint's data settings, "
                                 "or set checkpoint.resume=none to start fresh") from None
        elif own is None:
            saved = sorted(k for k in (self.keys_in_checkpoint or ()) if k.startswith("data_rank"))
            raise ValueError(
                f"checkpoint has no data position for data rank {self.data_rank} (it has {len(saved)} data ranks, "
                "dp_replicate x dp_shard x ep): resume with the data-parallel sizes it was saved with, or set "
                "checkpoint.resume=none to start fresh")
        else:
            try:
                self.loader.load_state_dict(own)
            except ValueError as e:
                raise ValueError(f"cannot resume the data position: {e}. Resume with the checkpoint's number of data "
                                 "ranks (dp_replicate x dp_shard x ep) and data.num_workers, or set "
                                 "checkpoint.resume=none to start fresh") from None
        if self.rng_key in state:  # else: a rank the saving run did not have keeps its fresh seed
            _set_rng_state(pickle.loads(state[self.rng_key]))


def model_config_differences(saved: dict, current: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """(key, saved value, current value) for every model config key that differs and changes parameters. A key the
    saved config lacks is none: the checkpoint predates it, and a key is added with a default that keeps the older
    models' parameters (a section such as `dspark` or `vision` describes parts those checkpoints do not hold)."""
    out = []
    for key in sorted(set(saved) | set(current)):
        if key not in saved:
            continue
        name = f"{prefix}{key}"
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += model_config_differences(a, b, f"{name}.")
        elif a != b and not any(name == k or (k.endswith(".") and name.startswith(k)) for k in RESUMABLE_MODEL_KEYS):
            out.append((name, a, b))
    return out


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(local: dict) -> dict:
    """The union of every rank's dict (on every rank)."""
    rank, world = rank_and_world()
    if world == 1:
        return local
    parts: list = [None] * world
    dist.all_gather_object(parts, local)
    return {k: v for part in parts for k, v in part.items()}


def file_checksums(path: Path) -> dict[str, dict]:
    """{file name: {size, sha256}} of every file of a checkpoint directory (but the marker), each rank hashing a
    share; every rank of the job must call it."""
    rank, world = rank_and_world()
    names = sorted(f.name for f in Path(path).iterdir() if f.is_file() and f.name != COMPLETE_MARKER)
    mine = {n: {"size": (Path(path) / n).stat().st_size, "sha256": file_sha256(Path(path) / n)}
            for i, n in enumerate(names) if i % world == rank}
    return _gather(mine)


def verify(path: Path) -> list[str]:
    """What is wrong with a complete checkpoint's files against its marker's checksums ([] = intact, or a
    checkpoint from before checksums). Every rank of the job must call it; all get the same answer."""
    rank, world = rank_and_world()
    recorded = json.loads((Path(path) / COMPLETE_MARKER).read_text()).get("files")
    if recorded is None:
        return []
    problems = {}
    for i, (name, want) in enumerate(sorted(recorded.items())):
        if i % world != rank:
            continue
        f = Path(path) / name
        if not f.is_file():
            problems[name] = f"{name} is missing"
        elif f.stat().st_size != want["size"]:
            problems[name] = f"{name} has {f.stat().st_size} bytes, {want['size']} were written"
        elif file_sha256(f) != want["sha256"]:
            problems[name] = f"{name} does not match its sha256"
    problems = _gather(problems)
    return [problems[k] for k in sorted(problems)]


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind a failed save: raised directly, chained, or inside DCP's CheckpointException (which
    carries each failed rank's exception)."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return None


class _ReusedStager(BlockingAsyncStager):
    """An asynchronous save's copy of the state (DCP's staging), into host buffers allocated at the first save and
    reused by every later one: page-locked when the state lives on a GPU (the copy then runs at DMA speed; into
    fresh pageable memory an H100 host copied v41_small's 12 GB state in 7 s, BENCHMARKS.md), plain on a CPU. A
    state of another structure (an optimiser state that appeared since) gets new buffers. The step blocks until the
    copy is done, so training may change the state as soon as `save` returns."""

    def __init__(self) -> None:
        super().__init__(cache_staged_state_dict=True)
        self._shapes = None

    def stage(self, state_dict):
        from torch.distributed._state_dict_utils import CompanionMismatch, _copy_state_dict, _create_cpu_state_dict

        from torch.utils._pytree import tree_leaves

        tensors = [t for t in tree_leaves(state_dict) if isinstance(t, torch.Tensor)]
        cuda = any(t.is_cuda for t in tensors)
        shapes = [(tuple(t.shape), t.dtype) for t in tensors]
        if self.state_dict_cache is not None and shapes == self._shapes:
            try:
                staged = _copy_state_dict(state_dict, self.state_dict_cache, non_blocking=cuda,
                                          type_check=self.type_check)
            except CompanionMismatch:  # the same tensors under other keys
                staged = None
        else:
            staged = None
        if staged is None:
            self.state_dict_cache = None  # the old buffers freed before the new ones are taken
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=cuda)
            self._shapes = shapes
            staged = _copy_state_dict(state_dict, self.state_dict_cache, non_blocking=cuda, type_check=self.type_check)
        if cuda:
            torch.cuda.synchronize()
        return staged


class Checkpointer:
    """Saves and finds checkpoints under one directory (`<run dir>/checkpoints`). `info` (JSON-able: the model
    config, the parallel sizes) is recorded in every checkpoint's marker."""

    def __init__(self, root: Path, cfg: CheckpointConfig, rank: int = 0, info: dict | None = None) -> None:
        self.root, self.cfg, self.rank = Path(root), cfg, rank
        self.info = info or {}
        self.pending = None  # the asynchronous save in flight: (step, tmp dir, final dir, extra, future)
        self._group = None
        self._stager = _ReusedStager() if cfg.async_staging == "reused" else None

    def due(self, step: int, max_steps: int) -> bool:
        periodic = self.cfg.interval > 0 and step % self.cfg.interval == 0
        return periodic or (self.cfg.save_final and step == max_steps)

    def resume_path(self) -> Path | None:
        """The checkpoint to start from according to `checkpoint.resume`, or None for a fresh start. With `auto`,
        the newest complete checkpoint whose files match their checksums (a corrupt one is skipped with a warning
        naming it and the one taken instead). Every rank of the job must call it (the check is shared)."""
        if self.cfg.resume == "none":
            return None
        if self.cfg.resume == "auto":
            found = complete_checkpoints(self.root)
            for newest, path in enumerate(reversed(found)):
                problems = verify(path)
                if not problems:
                    return path
                older = found[-newest - 2] if newest + 1 < len(found) else None
                log.warning("checkpoint %s is corrupt (%s): resuming from %s instead", path, "; ".join(problems),
                            older if older is not None else "nothing (a fresh start)")
            return None
        path = Path(self.cfg.resume)
        if not is_complete(path):
            raise ValueError(f"checkpoint.resume={self.cfg.resume!r} is not a complete checkpoint directory")
        problems = verify(path)
        if problems:
            raise CorruptCheckpoint(f"checkpoint.resume={self.cfg.resume!r} is corrupt: {'; '.join(problems)}")
        return path

    @staticmethod
    def marker(path: Path) -> dict:
        return json.loads((Path(path) / COMPLETE_MARKER).read_text())

    def check_model(self, path: Path, model_cfg) -> None:
        """ValueError naming every model config key whose value differs from the checkpoint's in a way that changes
        the parameters (checkpoints without a recorded config, format 1, are not checked)."""
        saved = self.marker(path).get("model")
        if saved is None:
            return
        diff = model_config_differences(saved, dataclasses.asdict(model_cfg))
        if diff:
            shown = "; ".join(f"model.{k}={a!r} there, {b!r} here" for k, a, b in diff)
            fix = " ".join(f"model.{k}={_override(a)}" for k, a, _ in diff)
            raise ValueError(f"checkpoint {path} was saved with another model: {shown}. Resume with the "
                             f"checkpoint's values ({fix}) or start fresh with checkpoint.resume=none")

    def load(self, path: Path, states: dict) -> None:
        reader = FileSystemReader(str(path))
        saved = set(reader.read_metadata().state_dict_metadata)
        for name, state in states.items():
            if isinstance(state, RankLocalState):
                state.keys_in_checkpoint = {k[len(name) + 1:] for k in saved if k.startswith(f"{name}.")}
                state.checkpoint_path = (Path(path), name)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                dcp.load(states, storage_reader=reader)
        finally:
            for state in states.values():
                if isinstance(state, RankLocalState):
                    state.keys_in_checkpoint = state.checkpoint_path = None

    def save(self, step: int, states: dict, extra: dict | None = None, planner=None,
             file_per_item: bool = False, wait: bool = True) -> Path | None:
        """Write `states` as checkpoint `step` (every rank); `extra` joins `info` in the marker; `planner`: DCP's
        save planner (default DCP's; trainer/checkpoint/hf_io.py's import gives one that reads its tensors lazily);
        `file_per_item`: a file per tensor piece instead of one per rank (DCP's writer keeps every tensor of a file
        alive until the file is closed, so a lazy planner's pieces would otherwise all be in memory at the end).
        With checkpoint.async_save and wait=False the states are copied (staged) and the files written by a
        background thread: it returns None at once and `poll` / `finish` complete the checkpoint (the marker and the
        rename) once every rank's write is done; a save still in flight is finished first (at most one at a time).
        Raises CheckpointSaveError, on every rank, when the files could not be written."""
        self.finish()
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp_{step_dir_name(step)}"
        writer = FileSystemWriter(str(tmp), single_file_per_rank=not file_per_item)
        planner = planner or PieceSavePlanner(int(self.cfg.piece_mb * 2**20))
        with self._failures(step, tmp):
            if self.rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                for stale in self.root.glob(".tmp_step_*"):  # left by a crash during an earlier save
                    shutil.rmtree(stale, ignore_errors=True)
                tmp.mkdir()
            _barrier()
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                if self.cfg.async_save and not wait:
                    future = dcp.async_save(states, storage_writer=writer, planner=planner,
                                            process_group=self._async_group(), no_dist=not dist.is_initialized(),
                                            async_stager=self._stager)
                    self.pending = (step, tmp, final, extra, getattr(future, "upload_completion", future))
                    return None
                dcp.save(states, storage_writer=writer, planner=planner)
        return self._complete(step, tmp, final, extra)

    def poll(self) -> Path | None:
        """The in-flight asynchronous save's checkpoint once every rank's write finished (then completed: marker and
        rename), else None. Every rank calls it at the same points (one small all-reduce while a save is in
        flight): all of them complete the checkpoint together."""
        if self.pending is None:
            return None
        done = torch.tensor([int(self.pending[-1].done())], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return self.finish() if done.item() else None

    def finish(self) -> Path | None:
        """Wait for the in-flight asynchronous save (every rank) and complete it; its path, or None if none."""
        if self.pending is None:
            return None
        step, tmp, final, extra, future = self.pending
        self.pending = None
        with self._failures(step, tmp):
            future.result()  # the background write's error, if any, raises here
        return self._complete(step, tmp, final, extra)

    @property
    def pending_step(self) -> int | None:
        return None if self.pending is None else self.pending[0]

    def _async_group(self):
        """A process group of its own for the background thread's collectives (DCP's planning and its final
        gather), so that they never interleave with the training step's on the default group."""
        if not dist.is_initialized():
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _complete(self, step: int, tmp: Path, final: Path, extra: dict | None) -> Path:
        with self._failures(step, tmp):
            _barrier()  # every rank's files are on disk before the checkpoint is declared complete
            files = file_checksums(tmp)
            if self.rank == 0:
                marker = {"format": CHECKPOINT_FORMAT, "step": step, "saved_at": time.time(), **self.info,
                          **(extra or {}), "files": files}
                with open(tmp / COMPLETE_MARKER, "w") as f:
                    json.dump(marker, f)
                    f.flush()
                    os.fsync(f.fileno())
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
                self._prune()
        _barrier()
        return final

    @contextlib.contextmanager
    def _failures(self, step: int, tmp: Path):
        """A save's I/O failure as CheckpointSaveError (its partial files removed), on every rank."""
        try:
            yield
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            cause = _os_error(e)
            if cause is None:
                raise
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            previous = complete_checkpoints(self.root)
            what = "no space left on device" if cause.errno == errno.ENOSPC else (cause.strerror or str(cause))
            where = cause.filename or tmp
            keep = (f"the previous checkpoint {previous[-1]} stays the one a resume starts from" if previous
                    else "no earlier checkpoint exists")
            raise CheckpointSaveError(f"saving checkpoint step {step} failed: {what} ({where}); {keep}") from None

    def _prune(self) -> None:
        for old in complete_checkpoints(self.root)[: -self.cfg.keep_last]:
            # drop the marker first: a crash halfway through the delete leaves an incomplete directory
            (old / COMPLETE_MARKER).unlink()
            shutil.rmtree(old, ignore_errors=True)


def _override(value) -> str:
    """A value as a Hydra override writes it."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_override(v) for v in value) + "]"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
