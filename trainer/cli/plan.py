"""`python -m trainer.cli.plan [--world-size=N] model=<name> [parallel=<layout>] [overrides...]`: the memory and
communication plan of a job (trainer/memory_plan.py says what it counts), one JSON object on stdout. What the
trainer would refuse at start-up, and a mistyped config group option, is one `error: ...` line and exit status 2.
"""

from __future__ import annotations

import json
import sys

from trainer.compose import compose
from trainer.memory_plan import plan


def _split_world_size(argv: list[str]) -> tuple[int | None, list[str]]:
    """`--world-size=N` (or `--world-size N`) out of the arguments; the rest are Hydra overrides."""
    world_size, rest, args = None, [], iter(argv)
    for a in args:
        if a == "--world-size" or a.startswith("--world-size="):
            value = a.partition("=")[2] if "=" in a else next(args, "")
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"--world-size takes a number of processes >= 1, got {value!r}")
            world_size = int(value)
        else:
            rest.append(a)
    return world_size, rest


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        world_size, overrides = _split_world_size(argv)
        result = plan(compose(overrides), world_size)
    except ValueError as e:  # the trainer's start-up errors and Hydra's, one line naming the key and the rule
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
