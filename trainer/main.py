"""The old path of `python -m trainer.cli.main` (trainer/cli/main.py): says so in one line, then runs it,
so that existing commands and scripts keep working."""

from trainer.cli.app import old_path
from trainer.cli.main import main

if __name__ == "__main__":
    old_path("trainer.main", "trainer.cli.main")
    main()
