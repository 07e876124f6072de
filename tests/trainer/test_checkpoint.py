"""Checkpoints: a round trip restores model, optimiser, scheduler, data position and RNG exactly; only renamed
directories with the completion marker count, keep-last-k prunes; and end to end, a run killed with SIGKILL
mid-training, or killed inside a save, resumes (checkpoint.resume=auto) from the newest complete checkpoint and
reproduces the uninterrupted run's losses exactly."""

import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from optim import LRScheduler, OptimConfig, build_optimizer
from tests.trainer.harness import REPO, env, losses, micro_overrides, read_metrics, run_cli
from trainer.checkpoint import (
    COMPLETE_MARKER, FAULT_ENV, Checkpointer, RankLocalState, TrainState, complete_checkpoints,
)
from trainer.config import CheckpointConfig


class _Loader:
    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"dp_rank_0": {"position": self.position}}

    def load_state_dict(self, state):
        self.position = state["dp_rank_0"]["position"]


def _toy(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3))
    model.register_buffer("bias_like", torch.randn(3))  # stands in for the MoE balancing biases
    cfg = OptimConfig(lr=1e-2, warmup_steps=2)
    opt = build_optimizer(model.parameters(), cfg)
    sched = LRScheduler(opt, cfg, total_steps=10)
    loader = _Loader()
    return model, opt, sched, loader, {"train": TrainState(model, opt, sched), "rank_local": RankLocalState(loader, 0)}


def _train_steps(model, opt, sched, n):
    for _ in range(n):
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def test_round_trip_restores_everything(tmp_path):
    model, opt, sched, loader, states = _toy(0)
    _train_steps(model, opt, sched, 3)
    states["train"].step, states["train"].tokens_seen, loader.position = 3, 96, 17
    model.bias_like += 1
    ckpt = Checkpointer(tmp_path, CheckpointConfig())
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    path = ckpt.save(3, states)
    expected_rng = (random.random(), np.random.rand(), torch.rand(1))

    model2, opt2, sched2, loader2, states2 = _toy(1)
    ckpt.load(path, states2)
    assert states2["train"].step == 3 and states2["train"].tokens_seen == 96 and loader2.position == 17
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name
    assert sched2.steps_done == 3 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected_rng
    # the next update is the same: optimiser moments and step counts came back too
    torch.manual_seed(9)
    _train_steps(model, opt, sched, 1)
    torch.manual_seed(9)
    _train_steps(model2, opt2, sched2, 1)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_only_marked_step_dirs_count_and_old_ones_are_pruned(tmp_path):
    model, opt, sched, loader, states = _toy(0)
    ckpt = Checkpointer(tmp_path, CheckpointConfig(keep_last=2))
    for step in (1, 2, 3):
        ckpt.save(step, states)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    (tmp_path / ".tmp_step_00000004").mkdir()  # a save that died
    (tmp_path / "step_00000005").mkdir()  # a directory without the marker
    assert ckpt.resume_path().name == "step_00000003"
    ckpt.save(6, states)  # cleans the dead save's leftovers
    assert not (tmp_path / ".tmp_step_00000004").exists()
    assert Checkpointer(tmp_path, CheckpointConfig(resume="none")).resume_path() is None
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        Checkpointer(tmp_path, CheckpointConfig(resume=str(tmp_path / "step_00000005"))).resume_path()


# --- end to end: the CLI killed and resumed -------------------------------------------------------------------------

MAX_STEPS, INTERVAL = 24, 3
RUN_ARGS = [f"trainer.max_steps={MAX_STEPS}", f"checkpoint.interval={INTERVAL}", "checkpoint.keep_last=2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_data):
    run_dir = tmp_path_factory.mktemp("reference")
    r = run_cli(micro_overrides(run_dir, small_data, *RUN_ARGS))
    assert r.returncode == 0, r.stderr
    ref = losses(run_dir)
    assert sorted(ref) == list(range(1, MAX_STEPS + 1))
    return ref


def _resumed_from(result) -> int:
    line = next(line for line in result.stdout.splitlines() if "resumed from" in line)
    return int(line.rsplit("at step", 1)[1])


@pytest.mark.slow
def test_sigkill_mid_training_then_resume_matches(tmp_path, small_data, reference):
    args = micro_overrides(tmp_path, small_data, *RUN_ARGS)
    proc = subprocess.Popen([sys.executable, "-m", "trainer.main", *args], cwd=REPO, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if (tmp_path / "metrics.jsonl").exists() and len(read_metrics(tmp_path)) >= 2 * INTERVAL + 1:
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = max(losses(tmp_path))
    assert killed_at < MAX_STEPS

    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    start = _resumed_from(r)
    assert INTERVAL * 2 <= start <= killed_at and start % INTERVAL == 0
    assert losses(tmp_path) == reference  # every step, bit for bit, the resumed ones included
    assert [row["step"] for row in read_metrics(tmp_path)] == list(range(1, MAX_STEPS + 1))


@pytest.mark.slow
def test_crash_inside_save_leaves_no_complete_checkpoint(tmp_path, small_data, reference):
    args = micro_overrides(tmp_path, small_data, *RUN_ARGS)
    r = run_cli(args, **{FAULT_ENV: str(2 * INTERVAL)})
    assert r.returncode == 70, r.stderr  # died inside the save at step 6
    ckpts = tmp_path / "checkpoints"
    assert [p.name for p in complete_checkpoints(ckpts)] == ["step_00000003"]
    partial = ckpts / ".tmp_step_00000006"
    assert any(partial.glob("*.distcp")), "the fault should strike after tensor files were written"
    assert not (partial / COMPLETE_MARKER).exists() and not (ckpts / "step_00000006").exists()

    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    assert _resumed_from(r) == INTERVAL
    assert losses(tmp_path) == reference
    assert not partial.exists()
    assert [p.name for p in complete_checkpoints(ckpts)] == ["step_00000021", "step_00000024"]
