"""What the entry points share: a small app's main (`run_app`: help, its config composed, one line and exit 2 for
what it refuses), one line for a file an app could not read or write (`io_message`), the process group a
torchrun launch of an app needs (`join_world`) and the device a `device=auto|cpu|cuda` key names (`device_named`)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from trainer.checkpoint import CheckpointSaveError, rank_and_world
from trainer.compose import CONF_DIR, compose_app

__all__ = ["run_app", "io_message", "join_world", "leave_together", "device_named"]


def old_path(old: str, new: str) -> None:
    """An old command path (`python -m trainer.<old>`) says, in one line on stderr, the command it runs now."""
    print(f"note: `python -m {old}` is now `python -m {new}`; the old path will go", file=sys.stderr)


def io_message(e: OSError) -> str:
    """One line for a file the set-up could not read or write (the data, a tokenizer, the run directory)."""
    where = f" {e.filename}" if e.filename else ""
    return f"{e.strerror or e}:{where}" if e.strerror else str(e)


def device_named(name: str) -> torch.device:
    """The device of a `device` key: auto is cuda when one is available, else cpu; ValueError for cuda without one."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is available")
    return torch.device(name)


def join_world() -> tuple[int, int]:
    """(rank, world size), starting gloo when torchrun launched several processes."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    return rank_and_world()


def leave_together() -> None:
    """Before a process group is torn down after a finished run: a barrier, then every rank says it is through it on
    the launcher's store (not gloo) and waits for all. A rank that closed its gloo connections while a peer still
    read the barrier's last message would abort that peer ("terminate called without an active exception": seen in
    test_train's torchrun run and in import_hf's two-rank test); tests/distributed.py ends its workers the same way."""
    dist.barrier()
    store, world = distributed_c10d._get_default_store(), dist.get_world_size()
    store.add("cedar_shutdown", 1)
    while store.add("cedar_shutdown", 0) < world:
        time.sleep(0.01)


def run_app(config_name: str, schema, run, argv: Sequence[str] | None, doc: str) -> None:
    """A small app's main: `-h` / `--help` prints `doc` and conf/<config_name>.yaml; otherwise `run` gets the composed
    config (trainer/compose.py `compose_app`). A bad key, a bad value or a file it cannot read or write (a checkpoint
    it cannot save included) ends it with one line on stderr and exit status 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(doc.strip() + f"\n\nKeys (conf/{config_name}.yaml):\n" + (CONF_DIR / f"{config_name}.yaml").read_text())
        return
    try:
        run(compose_app(config_name, schema, argv))
        if dist.is_initialized():  # torchrun's ranks (join_world) leave together, then tear the group down
            leave_together()
            dist.destroy_process_group()
    except (ValueError, OSError, CheckpointSaveError) as e:  # the last: an output it could not write (import_hf)
        if isinstance(e, OSError):
            e = io_message(e)
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
