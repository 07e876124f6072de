"""What a launch leaves in its run directory when it trains nothing (trainer/run_lock.py `RunLock.discard_dir`,
trainer/train.py `build`): a launch that fails at start-up (a bad checkpoint.init_from) removes the run directory it
created (Hydra's `.hydra/`, an empty main.log) and keeps one that existed before; a relaunch of a finished run, with
nothing to do, starts no W&B run (no new offline run directory)."""

import pytest

from tests.trainer.harness import micro_overrides, run_cli


def test_a_failed_start_up_leaves_no_run_directory(tmp_path, small_data):
    run = tmp_path / "runs" / "2031-01-01_00-00-00"
    r = run_cli(micro_overrides(run, small_data, "trainer.max_steps=1", "checkpoint.init_from=/nonexistent/run"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: checkpoint.init_from: '/nonexistent/run' does not exist"]
    assert not run.exists() and (tmp_path / "runs").exists()

    run.mkdir()  # a relaunch into a directory of its own: kept
    (run / "notes.txt").write_text("mine")
    r = run_cli(micro_overrides(run, small_data, "trainer.max_steps=1", "checkpoint.init_from=/nonexistent/run"))
    assert r.returncode == 2 and (run / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_a_relaunch_with_nothing_to_do_creates_nothing(tmp_path, small_data):
    args = micro_overrides(tmp_path, small_data, "trainer.max_steps=1", "checkpoint.interval=1",
                           "logger.wandb.mode=offline")
    r = run_cli(args)
    assert r.returncode == 0, r.stderr[-2000:]
    before = sorted(p.name for p in (tmp_path / "wandb").iterdir())
    assert any(name.startswith("offline-run-") for name in before)
    r = run_cli(args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "nothing to do" in r.stdout and "W&B files:     (none: nothing to do)" in r.stdout
    assert sorted(p.name for p in (tmp_path / "wandb").iterdir()) == before
