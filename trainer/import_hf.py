"""The old path of `python -m trainer.cli.import_hf` (trainer/cli/import_hf.py): says so in one line, then runs it,
so that existing commands and scripts keep working."""

from trainer.cli.app import old_path
from trainer.cli.import_hf import main

if __name__ == "__main__":
    old_path("trainer.import_hf", "trainer.cli.import_hf")
    main()
