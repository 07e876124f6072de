"""Job configuration: the CLI rejects a misspelled key, a wrong type and a bad value at start-up with a clear
message naming the full key path and a non-zero exit (no traceback wall); `--cfg job` and `-m` multirun work;
the schemas' own checks (parallel sizes vs world size, unsupported dimensions) raise ValueErrors naming the key."""

import pytest

from tests.trainer.harness import losses, micro_overrides, run_cli
from trainer.config import CheckpointConfig, ParallelConfig, StageConfig, TrainerConfig


def _cli(tmp_path, *args):
    return run_cli([f"hydra.run.dir={tmp_path / 'run'}", *args])


def test_misspelled_key_fails_naming_the_key(tmp_path):
    r = _cli(tmp_path, "trainer.max_stepz=3")
    assert r.returncode != 0
    assert "trainer.max_stepz" in r.stderr
    assert "Traceback" not in r.stderr


def test_appended_unknown_key_fails_naming_the_key(tmp_path):
    # Hydra's `+key=value` slips past struct mode; trainer.config.to_config catches it before anything runs
    r = _cli(tmp_path, "+logger.wandb.projekt=x")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "error: Key 'projekt' not in 'WandbConfig' (full key: logger.wandb.projekt)"
    )


def test_wrong_type_fails_naming_the_key(tmp_path):
    r = _cli(tmp_path, "trainer.max_steps=many")
    assert r.returncode != 0
    assert "trainer.max_steps" in r.stderr and "many" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_value_exits_2_with_one_line(tmp_path):
    r = _cli(tmp_path, "trainer.device=tpu")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "error: trainer.device must be one of ['auto', 'cpu', 'cuda'], got 'tpu'"
    )
    assert "Traceback" not in r.stderr


def test_bad_model_value_is_reported_by_the_model_schema(tmp_path):
    r = _cli(tmp_path, "model.moe.experts_per_token=99")
    assert r.returncode == 2
    assert "model.moe.experts_per_token=99 exceeds num_experts" in r.stderr
    assert "Traceback" not in r.stderr


def test_cfg_job_prints_the_composed_config(tmp_path):
    r = run_cli(["--cfg", "job", f"hydra.run.dir={tmp_path}", "trainer.max_steps=7", "optim=adamw_wsd"])
    assert r.returncode == 0, r.stderr
    assert "max_steps: 7" in r.stdout and "schedule: wsd" in r.stdout and "name: v41_tiny" in r.stdout


@pytest.mark.slow
def test_multirun_sweeps_overrides(tmp_path, small_data):
    sweep = tmp_path / "sweep"
    args = [a for a in micro_overrides(tmp_path / "unused", small_data) if not a.startswith("hydra.run.dir")]
    r = run_cli(["-m", *args, f"hydra.sweep.dir={sweep}", "trainer.max_steps=1,2", "checkpoint.interval=0"])
    assert r.returncode == 0, r.stderr
    assert sorted(losses(sweep / "0")) == [1]
    assert sorted(losses(sweep / "1")) == [1, 2]


def test_parallel_sizes_must_match_world_size():
    assert ParallelConfig(dp_replicate=-1).resolve(4).dp == 4
    assert ParallelConfig(dp_replicate=2).resolve(2).world_size == 2
    with pytest.raises(ValueError, match="must equal the world size 4"):
        ParallelConfig(dp_replicate=2).resolve(4)


@pytest.mark.parametrize("dim", ["dp_shard", "tp", "pp", "ep", "cp"])
def test_unsupported_parallel_dims_are_refused(dim):
    with pytest.raises(ValueError, match=f"parallel.{dim}=2 is not supported yet"):
        ParallelConfig(**{dim: 2})


def test_field_checks_name_key_and_value():
    with pytest.raises(ValueError, match=r"trainer.grad_accum must be >= 1, got 0"):
        TrainerConfig(grad_accum=0)
    with pytest.raises(ValueError, match=r"trainer.precision must be one of .*got 'fp8'"):
        TrainerConfig(precision="fp8")
    with pytest.raises(ValueError, match=r"stage.name must be one of .*got 'midtrain'"):
        StageConfig(name="midtrain")
    with pytest.raises(ValueError, match=r"checkpoint.keep_last must be >= 1, got 0"):
        CheckpointConfig(keep_last=0)
