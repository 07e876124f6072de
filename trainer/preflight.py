"""The old path of `python -m trainer.cli.preflight` (trainer/cli/preflight.py): says so in one line, then runs it,
so that existing commands and scripts keep working."""

from trainer.cli.app import old_path
from trainer.cli.preflight import main

if __name__ == "__main__":
    old_path("trainer.preflight", "trainer.cli.preflight")
    main()
