"""Forwards `python -m trainer.main` to `python -m trainer.cli.main` (trainer/cli/main.py), so
that existing commands and scripts keep working."""

from trainer.cli.main import main

if __name__ == "__main__":
    main()
