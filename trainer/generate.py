"""The old path of `python -m trainer.cli.generate` (trainer/cli/generate.py): says so in one line, then runs it,
so that existing commands and scripts keep working."""

from trainer.cli.app import old_path
from trainer.cli.generate import main

if __name__ == "__main__":
    old_path("trainer.generate", "trainer.cli.generate")
    main()
