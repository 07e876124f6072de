"""The commands' old module paths (`python -m trainer.main`, `trainer.plan`, `trainer.pipeline`, ...) forward to
trainer/cli/: each runs the same `main`, so existing commands and scripts keep working, after one line naming the new
command."""

import importlib
import subprocess
import sys

import pytest

from tests.trainer.harness import REPO, env

OLD_TO_NEW = {"main": "main", "generate": "generate", "export_hf": "export_hf", "import_hf": "import_hf",
              "plan": "plan", "preflight": "preflight", "pipeline": "stage_chain"}


@pytest.mark.parametrize("old", sorted(OLD_TO_NEW))
def test_an_old_path_runs_the_new_main(old):
    new = importlib.import_module(f"trainer.cli.{OLD_TO_NEW[old]}")
    assert importlib.import_module(f"trainer.{old}").main is new.main


def test_an_old_command_runs():
    r = subprocess.run([sys.executable, "-m", "trainer.preflight", "1", "trainer.max_stepz=3"], cwd=REPO, env=env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    note, error = r.stderr.strip().splitlines()  # the old path's note, then the command's own one line
    assert "`python -m trainer.cli.preflight`" in note
    assert "trainer.max_stepz" in error
