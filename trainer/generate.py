"""Forwards `python -m trainer.generate` to `python -m trainer.cli.generate` (trainer/cli/generate.py), so
that existing commands and scripts keep working."""

from trainer.cli.generate import main

if __name__ == "__main__":
    main()
