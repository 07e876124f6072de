"""The launcher's preflight: launch/torchrun.sh with a layout that does not fit its number of processes fails in one
line before torchrun starts (no per-rank errors, no torchrun failure report); trainer.cli.preflight refuses what the
trainer's start-up refuses (a layout, a misspelled key) and passes what it accepts."""

import subprocess

import pytest

from tests.trainer.harness import REPO, env
from trainer.cli.preflight import check


def test_a_world_size_mismatch_under_torchrun_is_one_line(tmp_path):
    r = subprocess.run(["bash", str(REPO / "launch" / "torchrun.sh"), "2", "parallel.dp_replicate=1",
                        f"hydra.run.dir={tmp_path}"], cwd=REPO, env=env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: parallel: dp_replicate*dp_shard*tp*pp*ep*cp = 1*1*1*1*1*1 = 1 must equal the world size 2: launch 1 "
        "processes, change the sizes, or set parallel.dp_replicate=-1 to fill"]
    assert not any(tmp_path.iterdir())  # nothing started


def test_preflight_refuses_what_the_trainer_refuses():
    check(2, [])  # the default layout fills dp_replicate
    check(4, ["parallel.dp_shard=2"])
    with pytest.raises(ValueError, match="parallel.tp=3 does not divide model.attention.num_heads=4"):
        check(3, ["parallel.tp=3"])
    with pytest.raises(ValueError, match="trainer.max_stepz"):
        check(1, ["trainer.max_stepz=3"])
