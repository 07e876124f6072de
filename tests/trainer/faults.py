"""Fault injection for the end-to-end trainer tests, kept out of the product code: run the trainer's CLI with faults
patched in.

    python -m tests.trainer.faults FAULT[,FAULT...] -- [hydra overrides...]

Faults (N: a step number; steps count this launch's optimiser steps from the resumed step + 1):
- crash_in_save=N: the save of step N kills the process (os._exit(70)) after the tensor files are written, before
  DCP's metadata and the completion marker;
- enospc_in_save=N: writing the tensor files of step N's save raises OSError(ENOSPC) (a full disk);
- nan_at=N+M+...: the loss of those steps is NaN and so is one gradient (a diverging step);
- nan_grad_at=N+M+...: the loss is finite but one gradient is NaN (the gradient norm catches it).
"""

from __future__ import annotations

import errno
import math
import os
import runpy
import sys
from pathlib import Path


def _crash_in_save(step: int) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    from trainer import checkpoint

    original_save, original_finish = checkpoint.Checkpointer.save, FileSystemWriter.finish
    saving = {}

    def save(self, at, states, extra=None, **options):
        saving["step"] = at
        return original_save(self, at, states, extra, **options)

    def finish(self, metadata, results):
        if saving.get("step") == step:
            os._exit(70)
        return original_finish(self, metadata, results)

    checkpoint.Checkpointer.save, FileSystemWriter.finish = save, finish


def _enospc_in_save(step: int) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    from trainer import checkpoint

    original_save, original_write = checkpoint.Checkpointer.save, FileSystemWriter.write_data
    saving = {}

    def save(self, at, states, extra=None, **options):
        saving["step"] = at
        return original_save(self, at, states, extra, **options)

    def write_data(self, plan, planner):
        if saving.get("step") == step:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return original_write(self, plan, planner)

    checkpoint.Checkpointer.save, FileSystemWriter.write_data = save, write_data


def _nan_at(steps: set[int], loss_too: bool = True) -> None:
    from trainer import train

    original = train.forward_backward
    calls = {"n": 0}

    def forward_backward(pm, batches, *args, **kwargs):
        calls["n"] += 1
        micro = original(pm, batches, *args, **kwargs)
        if calls["n"] in steps:
            if loss_too:
                micro.loss = math.nan
            grad = next(p.grad for p in pm.module.parameters() if p.grad is not None)
            grad.fill_(math.nan)
        return micro

    train.forward_backward = forward_backward


def install(spec: str) -> None:
    for item in filter(None, spec.split(",")):
        name, _, value = item.partition("=")
        if name == "crash_in_save":
            _crash_in_save(int(value))
        elif name == "enospc_in_save":
            _enospc_in_save(int(value))
        elif name == "nan_at":
            _nan_at({int(v) for v in value.split("+")})
        elif name == "nan_grad_at":
            _nan_at({int(v) for v in value.split("+")}, loss_too=False)
        else:
            raise SystemExit(f"tests.trainer.faults: unknown fault {name!r}")


def main() -> None:
    spec, sep, *overrides = sys.argv[1:] + [""] * (2 - len(sys.argv[1:]))
    if sep != "--":
        raise SystemExit("usage: python -m tests.trainer.faults FAULT[,FAULT...] -- [hydra overrides...]")
    install(spec)
    # as `python -m trainer.cli.main` runs it: Hydra finds conf/ relative to the file only when it runs as __main__
    sys.argv = [str(Path(__file__).resolve().parents[2] / "trainer" / "cli" / "main.py"), *[o for o in overrides if o]]
    runpy.run_module("trainer.cli.main", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
