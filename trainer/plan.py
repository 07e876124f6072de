"""Forwards `python -m trainer.plan` to `python -m trainer.cli.plan` (trainer/cli/plan.py), so
that existing commands and scripts keep working."""

from trainer.cli.plan import main

if __name__ == "__main__":
    main()
