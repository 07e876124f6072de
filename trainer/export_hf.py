"""Forwards `python -m trainer.export_hf` to `python -m trainer.cli.export_hf` (trainer/cli/export_hf.py), so
that existing commands and scripts keep working."""

from trainer.cli.export_hf import main

if __name__ == "__main__":
    main()
