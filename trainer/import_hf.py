"""Forwards `python -m trainer.import_hf` to `python -m trainer.cli.import_hf` (trainer/cli/import_hf.py), so
that existing commands and scripts keep working."""

from trainer.cli.import_hf import main

if __name__ == "__main__":
    main()
