"""The post-training stages end to end on the micro model (trainer/stages/): SFT, RL and distillation start from a
pretrained run's weights (checkpoint.init_from), log their headline figures, and resume after kill -9 with the
uninterrupted run's losses; bad starts and bad teachers are refused in one line; each stage's progress line shows its
headline figure; a stop signal during a held-out evaluation stops the run after the step, with a checkpoint."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer.harness import REPO, env, kill_9_when, micro_overrides, read_metrics, run_cli
from trainer.checkpoint import is_complete

# the micro model with head dims the FP8 / FP4 fake-quant blocks divide (the post-training hooks are on)
HOOKED = ["model.attention.head_dim=32", "model.csa2.index_head_dim=32"]
STEPS = ["trainer.max_steps=4", "checkpoint.interval=2"]
ROLLOUT = ["stage.prompts_per_step=2", "stage.group_size=4", "stage.max_new_tokens=6", "stage.num_eval=4",
           "stage.eval_every=2"]


def _args(run_dir: Path, data: Path, *extra: str) -> list[str]:
    return micro_overrides(run_dir, data, *HOOKED, *extra)


def _losses(run_dir: Path) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(run_dir) if "loss" in r}


def _evals(run_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(run_dir) if key in r}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, small_data):
    run = tmp_path_factory.mktemp("pretrain")
    r = run_cli(_args(run, small_data, "trainer.max_steps=4", "checkpoint.interval=4"))
    assert r.returncode == 0, r.stderr[-2000:]
    return run


def _stage_args(stage: str, run: Path, data: Path, pretrained: Path) -> list[str]:
    extra = {"sft": ["stage=sft", "stage.num_samples=64", "stage.num_eval=16", "stage.eval_every=2"],
             "rl": ["stage=rl", "stage.dynamic_sampling=false", *ROLLOUT],
             "distill": ["stage=distill", f"stage.teacher.ckpt={pretrained}", *ROLLOUT, "stage.group_size=2"]}[stage]
    return _args(run, data, *STEPS, f"checkpoint.init_from={pretrained}", *extra)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_data, pretrained):
    """Each stage's uninterrupted run: {stage: run dir}."""
    runs = {}
    for stage in ("sft", "rl", "distill"):
        run = tmp_path_factory.mktemp(stage)
        r = run_cli(_stage_args(stage, run, small_data, pretrained))
        assert r.returncode == 0, f"{stage}: {r.stderr[-3000:]}"
        runs[stage] = run
    return runs


def test_sft_starts_from_the_pretrained_weights_and_scores_held_out_assistant_tokens(reference, pretrained):
    run = reference["sft"]
    marker = json.loads((run / "checkpoints" / "step_00000004" / "COMPLETE").read_text())
    assert marker["stage"] == "sft" and marker["init_from"].startswith(str(pretrained.resolve()))
    assert marker["model"]["quant"]["main_kv"] == "fp4" and marker["model"]["csa2"]["hierarchical_pool"]
    evals = _evals(run, "eval/loss")
    assert sorted(evals) == [0, 2, 4] and evals[4] < evals[0]
    # a step's loss is over assistant tokens only: it starts near the held-out loss of the same weights
    assert abs(_losses(run)[1][0] - evals[0]) < 1.0


def test_rl_logs_every_rollout_figure(reference):
    records = [r for r in read_metrics(reference["rl"]) if "loss" in r]
    assert len(records) == 4
    for key in ("rl/reward", "rl/success", "rl/success/arithmetic", "rl/response_len", "rl/clip_frac",
                "rl/mismatch_kl", "rl/max_ratio", "rl/entropy", "rl/rollout_tokens_per_s", "rl/generate_share",
                "rl/groups_kept"):
        assert all(key in r for r in records), key
    assert all(r["rl/train_tokens"] > 0 and r["rl/groups_kept"] == 2 for r in records)
    # with one update per rollout the training forward scores the rollout's own policy: the ratio stays ~1
    assert all(r["rl/max_ratio"] < 1.01 and r["rl/mismatch_kl"] < 1e-4 for r in records)
    assert sorted(_evals(reference["rl"], "eval/success")) == [0, 2, 4]


def test_distillation_logs_the_held_out_kl_to_its_teacher(reference):
    kl = _evals(reference["distill"], "eval/kl")
    assert sorted(kl) == [0, 2, 4] and all(v >= 0 for v in kl.values())
    assert all("distill/reverse_kl" in r for r in read_metrics(reference["distill"]) if "loss" in r)


def test_each_stage_progress_line_shows_its_headline_and_its_evaluation_logs_under_its_name(reference):
    """Issue 44: RL's progress lines showed loss, lr and tokens/s but not the reward or success; distillation's
    held-out figures were logged under trainer.stages.rl."""
    rl, distill = ((reference[s] / "main.log").read_text() for s in ("rl", "distill"))
    assert re.search(r"step 4/4 \| loss \S+ \| rl/reward \S+ \| rl/success \S+ \| lr", rl)
    assert re.search(r"step 4/4 \| loss \S+ \| distill/reverse_kl \S+ \| lr", distill)
    assert "[trainer.stages.rl][INFO] - step 4: eval/success_e20" in rl
    assert "[trainer.stages.distill][INFO] - step 4: eval/kl" in distill


def test_a_stop_during_the_held_out_evaluation_is_honoured_at_once(tmp_path, small_data, pretrained):
    """Issue 44: a SIGTERM during RL's first evaluation (140 s of a random model's answers) was not acted on until
    trainer.stop_deadline_s killed the run without a checkpoint. The evaluation goes one engine batch at a time and
    is left out once a stop came; the run stops after its first step, with a checkpoint. The evaluation here is long
    (800 greedy answers in batches of 4) and the signal comes as soon as the start-up logs its initial weights."""
    args = _args(tmp_path, small_data, "trainer.max_steps=4", f"checkpoint.init_from={pretrained}", "stage=rl",
                 "stage.dynamic_sampling=false", "stage.prompts_per_step=2", "stage.group_size=2",
                 "stage.max_new_tokens=6", "stage.num_eval=400", "stage.max_batch=4", "trainer.stop_deadline_s=600")
    log = tmp_path / "main.log"
    proc = subprocess.Popen([sys.executable, "-m", "trainer.cli.main", *args], cwd=REPO, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if log.is_file() and "initialised from" in log.read_text():
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "stopped by SIGTERM at step 1/4: checkpoint saved" in out
    assert "step 0: held-out evaluation left out: SIGTERM came; the run stops with a checkpoint after step 1" in \
        log.read_text()
    assert not [r for r in read_metrics(tmp_path) if "eval/success" in r]
    assert is_complete(tmp_path / "checkpoints" / "step_00000001")


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sft", "rl", "distill"])
def test_kill_9_then_resume_reproduces_the_uninterrupted_losses(stage, tmp_path, small_data, pretrained, reference):
    args = _stage_args(stage, tmp_path, small_data, pretrained)
    code = kill_9_when(args, lambda: (tmp_path / "metrics.jsonl").exists() and max(_losses(tmp_path) or [0]) >= 3)
    assert code == -signal.SIGKILL, "the run finished before it could be killed"
    r = run_cli(args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout + r.stderr
    assert _losses(tmp_path) == _losses(reference[stage])  # bit for bit, the resumed steps included


def test_bad_starts_are_one_line(tmp_path, small_data, pretrained):
    r = run_cli(_args(tmp_path / "a", small_data, "stage=sft", "checkpoint.init_from=/nonexistent/run"))
    assert r.returncode == 2 and "checkpoint.init_from" in r.stderr and "Traceback" not in r.stderr
    r = run_cli(_args(tmp_path / "b", small_data, "stage=rl", "parallel.pp=2", f"checkpoint.init_from={pretrained}"))
    assert r.returncode == 2 and "parallel.pp and parallel.cp must be 1" in r.stderr and "Traceback" not in r.stderr
    r = run_cli(_args(tmp_path / "c", small_data, "stage=distill"))
    assert r.returncode == 2 and "stage.teacher.ckpt" in r.stderr
    r = run_cli(_args(tmp_path / "d", small_data, "stage=rl", "stage.group_sise=4"))
    assert r.returncode != 0 and "stage.group_sise" in r.stderr  # Hydra's composition error, naming the key
    r = run_cli(_args(tmp_path / "e", small_data, "stage=rl", "stage.rollout_cuda_graph=on",
                      f"checkpoint.init_from={pretrained}"))
    assert r.returncode == 2 and "stage.rollout_cuda_graph=on" in r.stderr and "Traceback" not in r.stderr


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path, pretrained):
    from omegaconf import OmegaConf

    from data.tokenizer import train_tokenizer
    from trainer.checkpoint.loading import find_checkpoint, run_tokenizer
    from trainer.stages.common import load_frozen

    other = tmp_path / "teacher"
    shutil.copytree(pretrained, other)
    tok = train_tokenizer(["another corpus entirely " * 20], 300)
    tok.save(str(tmp_path / "other.json"))
    conf = OmegaConf.load(other / ".hydra" / "config.yaml")
    conf.data.tokenizer = str(tmp_path / "other.json")
    OmegaConf.save(conf, other / ".hydra" / "config.yaml")
    ours = run_tokenizer(find_checkpoint(str(pretrained)))
    with pytest.raises(ValueError, match="another tokenizer"):
        load_frozen(str(other), "cpu", ours, what="teacher", key="stage.teacher.ckpt")
    assert load_frozen(str(pretrained), "cpu", ours, what="teacher", key="stage.teacher.ckpt") is not None
