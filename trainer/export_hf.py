"""The old path of `python -m trainer.cli.export_hf` (trainer/cli/export_hf.py): says so in one line, then runs it,
so that existing commands and scripts keep working."""

from trainer.cli.app import old_path
from trainer.cli.export_hf import main

if __name__ == "__main__":
    old_path("trainer.export_hf", "trainer.cli.export_hf")
    main()
