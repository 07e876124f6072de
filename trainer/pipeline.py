"""The old path of `python -m trainer.cli.stage_chain` (trainer/cli/stage_chain.py): says so in one line, then runs it,
so that existing commands and scripts keep working."""

import sys

from trainer.cli.app import old_path
from trainer.cli.stage_chain import main

if __name__ == "__main__":
    old_path("trainer.pipeline", "trainer.cli.stage_chain")
    sys.exit(main())
