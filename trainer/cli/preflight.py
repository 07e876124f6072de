"""`python -m trainer.cli.preflight WORLD_SIZE [hydra overrides...]`: the trainer's start-up checks of the config and
the layout against a world size, before any process starts.

launch/torchrun.sh runs it first: a layout that does not fit the number of processes (or any other bad value) is
then one `error: ...` line and exit status 2, instead of every rank printing the error and torchrun adding its
failure report. It composes the config as `python -m trainer.cli.main` does and runs the checks the trainer's `build`
runs before any process group (trainer.memory_plan.check_layout: `to_config`, the stage hooks, `validate_layout`,
`ParallelConfig.resolve`); nothing is built or loaded.
"""

from __future__ import annotations

import sys

from trainer.compose import compose
from trainer.memory_plan import check_layout
from trainer.stages.base import check_starting_weights


def check(world_size: int, overrides: list[str]) -> None:
    """ValueError (one line, naming the key) for what the trainer would refuse at start-up under world_size."""
    cfg = check_layout(compose(overrides), world_size)[0]
    check_starting_weights(cfg)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__.strip())
        return
    if not args or not args[0].isdigit() or int(args[0]) < 1:
        print("usage: python -m trainer.cli.preflight WORLD_SIZE [hydra overrides...]", file=sys.stderr)
        sys.exit(2)
    try:
        check(int(args[0]), args[1:])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
