"""Forwards `python -m trainer.pipeline` to `python -m trainer.cli.stage_chain` (trainer/cli/stage_chain.py), so
that existing commands and scripts keep working."""

import sys

from trainer.cli.stage_chain import main

if __name__ == "__main__":
    sys.exit(main())
