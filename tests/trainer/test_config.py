"""Job configuration: the CLI rejects a misspelled key, a wrong type and a bad value at start-up with a clear
message naming the full key path and a non-zero exit (no traceback wall); `--cfg job` and `-m` multirun work;
the schemas' own checks (parallel sizes vs world size, schedule vs virtual stages, ...) raise ValueErrors naming the
key and what to change; an impossible parallel layout fails before training with exit status 2."""

import pytest

from tests.trainer.harness import losses, micro_overrides, run_cli
from trainer.config import CheckpointConfig, ParallelConfig, StageConfig, TrainerConfig


def _cli(tmp_path, *args):
    return run_cli([f"hydra.run.dir={tmp_path / 'run'}", *args])


def test_misspelled_key_fails_naming_the_key(tmp_path):
    r = _cli(tmp_path, "trainer.max_stepz=3")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["error: unknown key trainer.max_stepz (did you mean trainer.max_steps?)"]


def test_appended_unknown_key_fails_naming_the_key(tmp_path):
    # Hydra's `+key=value` slips past struct mode; trainer.config.to_config catches it before anything runs
    r = _cli(tmp_path, "+logger.wandb.projekt=x")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "error: unknown key logger.wandb.projekt (did you mean logger.wandb.project?)"
    )


def test_wrong_type_fails_naming_the_key(tmp_path):
    r = _cli(tmp_path, "trainer.max_steps=many")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: trainer.max_steps: Value 'many' of type 'str' could not be converted to Integer"]


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
    dims = ParallelConfig(dp_replicate=-1, dp_shard=2, tp=2, pp=2, ep=2, cp=2).resolve(64)
    assert (dims.dp_replicate, dims.dp, dims.data, dims.world_size) == (2, 4, 8, 64)
    with pytest.raises(ValueError, match=r"= 2 must equal the world size 4: launch 2 processes.*dp_replicate=-1"):
        ParallelConfig(dp_replicate=2).resolve(4)
    with pytest.raises(ValueError, match=r"dp_shard\*tp\*pp\*ep\*cp = 1\*3\*1\*1\*1 = 3 does not divide the world "
                                         r"size 4 .*launch a multiple of 3 processes"):
        ParallelConfig(dp_replicate=-1, tp=3).resolve(4)


def test_parallel_field_checks_say_what_to_change():
    with pytest.raises(ValueError, match=r"pp_schedule=1F1B runs one stage per pipeline rank, got "
                                         r"parallel.pp_virtual=2: set parallel.pp_schedule=Interleaved1F1B"):
        ParallelConfig(pp=2, pp_virtual=2)
    with pytest.raises(ValueError, match=r"ZBVZeroBubble places exactly two stages .* set parallel.pp_virtual=2"):
        ParallelConfig(pp=2, pp_schedule="ZBVZeroBubble")
    with pytest.raises(ValueError, match=r"parallel.pp_schedule must be one of .*got 'GPipe'"):
        ParallelConfig(pp_schedule="GPipe")
    with pytest.raises(ValueError, match=r"pp_cuts=\[3, 6\] must hold pp \* pp_virtual - 1 = 1 layer indices"):
        ParallelConfig(pp=2, pp_cuts=[3, 6])
    # tp + sp + pp is a layout, not a refusal (tests/parallel/test_layouts.py tp2_sp_pp2)
    assert ParallelConfig(tp=2, pp=2, sequence_parallel=True).resolve(4).world_size == 4
    with pytest.raises(ValueError, match=r"parallel.timeout_s must be > 0, got 0"):
        ParallelConfig(timeout_s=0)
    with pytest.raises(ValueError, match=r"parallel.activation_checkpoint must be one of \['none', 'full'\], got "
                                         r"'sometimes'"):
        ParallelConfig(activation_checkpoint="sometimes")
    for over in (["tp"], [], ["ep", "ep"]):
        with pytest.raises(ValueError, match=r"parallel.engram_shard_over=.* must name distinct axes among "
                                             r"\['dp_replicate', 'dp_shard', 'ep', 'cp'\], at least one"):
            ParallelConfig(engram_shard=True, engram_shard_over=over)
    for name in ("dp_shard", "tp", "pp", "pp_virtual", "ep", "cp"):
        with pytest.raises(ValueError, match=f"parallel.{name} must be >= 1, got 0"):
            ParallelConfig(**{name: 0})


def test_impossible_layout_fails_before_training(tmp_path):
    # the model's rules first (they hold for any world size), then the world size
    r = _cli(tmp_path, "parallel.tp=3", "logger.wandb.mode=disabled")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "error: parallel.tp=3 does not divide model.attention.num_heads=4: tensor parallelism splits it evenly; "
        "choose a tp that divides it")
    r = _cli(tmp_path, "parallel.tp=2", "logger.wandb.mode=disabled")
    assert r.returncode == 2
    assert "does not divide the world size 1 (dp_replicate=-1 fills the rest): launch a multiple of 2" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_field_checks_name_key_and_value():
    with pytest.raises(ValueError, match=r"trainer.grad_accum must be >= 1, got 0"):
        TrainerConfig(grad_accum=0)
    with pytest.raises(ValueError, match=r"trainer.precision must be one of .*got 'fp8'"):
        TrainerConfig(precision="fp8")
    with pytest.raises(ValueError, match=r"stage.name must be one of .*got 'midtrain'"):
        StageConfig(name="midtrain")
    with pytest.raises(ValueError, match=r"checkpoint.keep_last must be >= 1, got 0"):
        CheckpointConfig(keep_last=0)


def test_data_traps_are_one_line_naming_the_key(tmp_path, small_data):
    """The commands that exposed the traps: a custom corpus over prepared standard-library shards and a missing data
    path without auto-preparation (a missing corpus or tokenizer file: tests/data/test_provenance.py)."""
    corpus = tmp_path / "mydir"
    corpus.mkdir()
    (corpus / "notes.txt").write_text("plain text, not Python\n" * 50)
    cases = {
        f"data.corpus={corpus}": f"data.path={str(small_data)!r} holds shards prepared from corpus '<stdlib>'",
        f"data.path={tmp_path / 'none'} data.auto_prepare=false": f"data.path={str(tmp_path / 'none')!r}",
    }
    for extra, start in cases.items():
        r = run_cli(micro_overrides(tmp_path / "run", small_data, "trainer.max_steps=1", *extra.split()))
        assert r.returncode == 2, (extra, r.stderr)
        (line,) = r.stderr.strip().splitlines()
        assert line.startswith(f"error: {start}"), (extra, line)
