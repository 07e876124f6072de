"""Forwards `python -m trainer.preflight` to `python -m trainer.cli.preflight` (trainer/cli/preflight.py), so
that existing commands and scripts keep working."""

from trainer.cli.preflight import main

if __name__ == "__main__":
    main()
