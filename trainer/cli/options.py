"""An argparse parser for the apps that take options rather than Hydra overrides (`report`, `stage_chain`): a bad
option or value is one `error: ...` line naming it and exit status 2, as in every entry point, instead of argparse's
usage block. Kept apart from app.py so that `report` starts without importing torch."""

from __future__ import annotations

import argparse
import sys

__all__ = ["OneLineParser"]


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        print(f"error: {message} ({self.prog} --help)", file=sys.stderr, flush=True)
        sys.exit(2)
