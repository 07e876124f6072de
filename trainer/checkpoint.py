"""Checkpoints with torch.distributed.checkpoint (DCP): atomic, keep-last-k, resumable.

A checkpoint is the directory `<run dir>/checkpoints/step_<N>/` holding two Stateful entries:
- `train`: model weights and buffers (MoE balancing biases included), optimiser, LR scheduler, step and
  tokens seen; identical on every rank under plain data parallelism.
- `rank_local`: each rank's data-loader position and RNG states (torch CPU/CUDA, python, numpy), under
  a rank-specific key so DCP keeps them all instead of deduplicating them as replicas.

Atomicity: every rank writes into `.tmp_step_<N>/`; only after all ranks finished does rank 0 write the
`COMPLETE` marker and rename the directory. A crash at any point before that leaves a `.tmp_*` directory,
which resume ignores and the next save deletes. Only a directory named `step_<N>` that holds the marker
counts as a checkpoint.

Fault injection for tests: with CEDAR_FAULT_CRASH_IN_SAVE=<N>, the save at step N kills the process
(os._exit) after the tensor files are written but before DCP's metadata and our marker.
"""

from __future__ import annotations

import json
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
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer.config import CheckpointConfig

COMPLETE_MARKER = "COMPLETE"
CHECKPOINT_FORMAT = 1  # bump when the layout of the Stateful entries changes; keep older formats loadable
FAULT_ENV = "CEDAR_FAULT_CRASH_IN_SAVE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


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
        self.step = 0
        self.tokens_seen = 0

    def state_dict(self) -> dict:
        return {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self.optimizer),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "tokens_seen": self.tokens_seen,
        }

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
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
    """Stateful: this rank's data position and RNG states, pickled to one opaque blob so that DCP neither
    flattens nor deduplicates them (the loader's state may change shape as it advances)."""

    def __init__(self, loader, rank: int) -> None:
        self.loader, self.rank = loader, rank

    @property
    def key(self) -> str:
        return f"rank{self.rank}"

    def state_dict(self) -> dict:
        blob = {"data": self.loader.state_dict(), "rng": _rng_state()}
        return {self.key: pickle.dumps(blob)}

    def load_state_dict(self, state: dict) -> None:
        blob = state[self.key]
        if not isinstance(blob, bytes):
            raise ValueError(f"checkpoint has no state for {self.key}: was it saved with another world size?")
        blob = pickle.loads(blob)
        self.loader.load_state_dict(blob["data"])
        _set_rng_state(blob["rng"])


class _CrashingWriter(FileSystemWriter):
    """Fault injection: dies after the tensor files are written, before metadata and marker."""

    def finish(self, metadata, results) -> None:
        os._exit(70)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class Checkpointer:
    """Saves and finds checkpoints under one directory (`<run dir>/checkpoints`)."""

    def __init__(self, root: Path, cfg: CheckpointConfig, rank: int = 0) -> None:
        self.root, self.cfg, self.rank = Path(root), cfg, rank

    def due(self, step: int, max_steps: int) -> bool:
        periodic = self.cfg.interval > 0 and step % self.cfg.interval == 0
        return periodic or (self.cfg.save_final and step == max_steps)

    def resume_path(self) -> Path | None:
        """The checkpoint to start from according to `checkpoint.resume`, or None for a fresh start."""
        if self.cfg.resume == "none":
            return None
        if self.cfg.resume == "auto":
            found = complete_checkpoints(self.root)
            return found[-1] if found else None
        path = Path(self.cfg.resume)
        if not is_complete(path):
            raise ValueError(f"checkpoint.resume={self.cfg.resume!r} is not a complete checkpoint directory")
        return path

    def load(self, path: Path, states: dict) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(states, checkpoint_id=str(path))

    def save(self, step: int, states: dict) -> Path:
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp_{step_dir_name(step)}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".tmp_step_*"):  # left by a crash during an earlier save
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        crash = os.environ.get(FAULT_ENV) == str(step)
        writer = (_CrashingWriter if crash else FileSystemWriter)(str(tmp))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(states, storage_writer=writer)
        _barrier()  # every rank's files are on disk before the checkpoint is declared complete
        if self.rank == 0:
            marker = {"format": CHECKPOINT_FORMAT, "step": step, "saved_at": time.time()}
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

    def _prune(self) -> None:
        for old in complete_checkpoints(self.root)[: -self.cfg.keep_last]:
            # drop the marker first: a crash halfway through the delete leaves an incomplete directory
            (old / COMPLETE_MARKER).unlink()
            shutil.rmtree(old, ignore_errors=True)
