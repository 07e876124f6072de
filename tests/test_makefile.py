"""`make clean` (Makefile) in a scratch copy of the project: it removes what the project writes (run directories
under runs/, Hydra's outputs/ and multirun/, wandb/, checkpoints/, Slurm logs, pytest's cache, __pycache__) and keeps
the sources, the virtual environment and the prepared data (.data/); it needs no virtual environment to run. And
.gitignore covers the run directories."""

import shutil
import subprocess

import pytest

from tests.helpers import ROOT

WRITTEN = ["runs/2031-01-01_00-00-00/checkpoints/step_10/x.distcp", "runs/multirun/2031/0/metrics.jsonl",
           "runs/slurm-42/.hydra/config.yaml", "outputs/a/main.log", "multirun/b/main.log", "wandb/offline-run/x",
           "checkpoints/step_1/x", ".pytest_cache/v/cache", "slurm-42.out", "trainer/__pycache__/plan.pyc",
           "tests/launch/__pycache__/x.pyc"]
KEPT = ["trainer/memory_plan.py", "conf/config.yaml", ".venv/bin/python", ".venv/lib/site/__pycache__/x.pyc",
        ".data/stdlib/shard-000000.tar", ".data/stdlib/__pycache__/kept.pyc", "runsheet.txt"]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_clean_removes_what_the_project_writes(tmp_path):
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    for rel in WRITTEN + KEPT:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    r = subprocess.run(["make", "clean"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    left = [rel for rel in WRITTEN if (tmp_path / rel).exists()]
    assert not left, left
    for top in ("runs", "outputs", "multirun", "wandb", "checkpoints", ".pytest_cache", "trainer/__pycache__"):
        assert not (tmp_path / top).exists(), top
    missing = [rel for rel in KEPT if not (tmp_path / rel).exists()]
    assert not missing, missing


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_gitignore_covers_run_directories():
    for path in ("runs/2031-01-01_00-00-00/metrics.jsonl", "runs/slurm-42/checkpoints", "outputs/x", "multirun/x",
                 ".data/stdlib"):
        r = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, timeout=30)
        assert r.returncode == 0, f"{path} is not ignored by .gitignore"


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_pipeline_passes_the_runners_options(tmp_path):
    """`make pipeline PIPELINE_ARGS=... ARGS=...` gives stage_chain its own options before `--`, the overrides after."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    r = subprocess.run(["make", "-n", "-o", ".venv/.cedar-installed", "pipeline",
                        "PIPELINE_ARGS=--scale 0.5 --root runs/x", "ARGS=trainer.num_threads=1"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "-m trainer.cli.stage_chain --scale 0.5 --root runs/x -- trainer.num_threads=1" in r.stdout
