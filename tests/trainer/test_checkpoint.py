"""Checkpoints: a round trip restores model, optimiser, scheduler, data position and RNG exactly, while the
optimiser's hyperparameters stay the live (config's) ones; only renamed directories with the completion marker
count, keep-last-k prunes; a checkpoint with a flipped byte, a truncated or a missing file fails its checksums and
`resume=auto` falls back to the previous complete one (an explicit path is refused); a save that runs out of space
removes its partial files and names the cause. End to end, a run killed with SIGKILL mid-training, or killed inside a
save, or resumed over a corrupted newest checkpoint, resumes (checkpoint.resume=auto) from the newest intact
checkpoint and reproduces the uninterrupted run's losses exactly; so does a run stopped by SIGTERM (it saves at the step it stops
and exits 0); a finished run launched again says there is nothing to do, and a resume with other optimiser
hyperparameters trains with them, logging each change.

Across layouts: the data position is keyed by data rank (a tp / pp / cp peer of data rank 0 resumes it; a data rank
the checkpoint lacks is refused), the RNG by global rank (a rank the checkpoint lacks keeps its fresh state); format 1
checkpoints still load; a model config that changes parameters is refused naming each key and both values, while
switches that change no parameter (kernels, quantisation hooks, balancing rate) may change.
(Moving weights and optimiser state between tp 2 x pp 2 and one process: tests/parallel/test_reshard.py.)"""

import dataclasses
import json
import pickle
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from optim import LRScheduler, OptimConfig, build_optimizer
from model.config import ModelConfig
from tests.trainer.harness import REPO, env, kill_9_when, losses, micro_overrides, read_metrics, run_cli, run_faulty
from trainer.checkpoint.checkpointer import (
    COMPLETE_MARKER, Checkpointer, CheckpointSaveError, CorruptCheckpoint, RankLocalState, TrainState, _rng_state,
    complete_checkpoints, model_config_differences, verify,
)
from trainer.config import CheckpointConfig


class _Loader:
    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"dp_rank_0": {"position": self.position}}

    def load_state_dict(self, state):
        self.position = state["dp_rank_0"]["position"]


def _toy(seed, **optim):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3))
    model.register_buffer("bias_like", torch.randn(3))  # stands in for the MoE balancing biases
    cfg = OptimConfig(**{"lr": 1e-2, "warmup_steps": 2, **optim})
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


def test_resume_keeps_the_configs_hyperparameters_and_the_checkpoints_state(tmp_path):
    model, opt, sched, loader, states = _toy(0)  # lr 1e-2, betas (0.9, 0.95), weight decay 0.1
    _train_steps(model, opt, sched, 3)
    path = Checkpointer(tmp_path, CheckpointConfig()).save(3, states)

    model2, opt2, sched2, _, states2 = _toy(1, lr=1e-3, betas=[0.8, 0.9], weight_decay=0.0, eps=1e-6)
    Checkpointer(tmp_path, CheckpointConfig()).load(path, states2)
    loaded = states2["train"].loaded_hyperparameters
    assert loaded[0]["initial_lr"] == 1e-2 and loaded[0]["weight_decay"] == 0.1  # what the checkpoint held
    for group in opt2.param_groups:  # the config's values, the lr at the resumed step's point of the schedule
        assert group["initial_lr"] == 1e-3 and group["betas"] == (0.8, 0.9) and group["eps"] == 1e-6
        assert group["lr"] == pytest.approx(opt.param_groups[0]["lr"] / 10)  # same schedule, a tenth of the peak
    assert opt2.param_groups[0]["weight_decay"] == 0.0
    for p, q in zip(model.parameters(), model2.parameters()):  # the moments are the checkpoint's
        assert torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"])
        assert torch.equal(opt.state[p]["step"], opt2.state[q]["step"])


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-1])


@pytest.mark.parametrize("damage", [_flip_byte, _truncate, lambda p: p.unlink()], ids=["flip", "truncate", "missing"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog, damage):
    model, opt, sched, loader, states = _toy(0)
    ckpt = Checkpointer(tmp_path, CheckpointConfig())
    first = ckpt.save(1, states)
    newest = ckpt.save(2, states)
    assert verify(first) == [] and verify(newest) == []
    marker = json.loads((newest / COMPLETE_MARKER).read_text())
    assert set(marker["files"]) == {f.name for f in newest.iterdir() if f.name != COMPLETE_MARKER}
    damage(next(newest.glob("*.distcp")))
    (problem,) = verify(newest)
    assert problem.startswith("__0_0.distcp")
    with caplog.at_level("WARNING"):
        assert ckpt.resume_path() == first
    assert f"checkpoint {newest} is corrupt" in caplog.text and f"resuming from {first} instead" in caplog.text
    with pytest.raises(CorruptCheckpoint, match="is corrupt: __0_0.distcp"):
        Checkpointer(tmp_path, CheckpointConfig(resume=str(newest))).resume_path()


def test_checkpoints_without_checksums_still_load(tmp_path):
    model, opt, sched, loader, states = _toy(0)
    path = Checkpointer(tmp_path, CheckpointConfig()).save(1, states)
    marker = json.loads((path / COMPLETE_MARKER).read_text())
    del marker["files"]
    (path / COMPLETE_MARKER).write_text(json.dumps(marker))
    assert verify(path) == [] and Checkpointer(tmp_path, CheckpointConfig()).resume_path() == path


def test_a_save_without_space_removes_its_files_and_names_the_cause(tmp_path, monkeypatch):
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    model, opt, sched, loader, states = _toy(0)
    ckpt = Checkpointer(tmp_path, CheckpointConfig())
    good = ckpt.save(1, states)

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    with pytest.raises(CheckpointSaveError, match=r"saving checkpoint step 2 failed: no space left on device \(") as e:
        ckpt.save(2, states)
    assert f"the previous checkpoint {good} stays the one a resume starts from" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]  # the partial directory is gone
    assert ckpt.resume_path() == good


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
def reference_dir(tmp_path_factory, small_data):
    """The uninterrupted run's directory (checkpoints step_21 and step_24, metrics of steps 1-24)."""
    run_dir = tmp_path_factory.mktemp("reference")
    r = run_cli(micro_overrides(run_dir, small_data, *RUN_ARGS))
    assert r.returncode == 0, r.stderr
    return run_dir


@pytest.fixture(scope="module")
def reference(reference_dir):
    ref = losses(reference_dir)
    assert sorted(ref) == list(range(1, MAX_STEPS + 1))
    return ref


def _copy_run(reference_dir, run_dir):
    """The reference run as if it had run in run_dir (a run directory holds no absolute path)."""
    shutil.copytree(reference_dir, run_dir, dirs_exist_ok=True)
    return run_dir / "checkpoints"


def _resumed_from(result) -> int:
    line = next(line for line in result.stdout.splitlines() if "resumed from" in line)
    return int(line.rsplit("at step", 1)[1])


@pytest.mark.slow
def test_sigkill_mid_training_then_resume_matches(tmp_path, small_data, reference):
    args = micro_overrides(tmp_path, small_data, *RUN_ARGS)
    code = kill_9_when(args, lambda: (tmp_path / "metrics.jsonl").exists()
                       and len(read_metrics(tmp_path)) >= 2 * INTERVAL + 1)
    assert code == -signal.SIGKILL, "the run finished before it could be killed"
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
    r = run_faulty(f"crash_in_save={2 * INTERVAL}", args)
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


@pytest.mark.slow
def test_a_corrupt_newest_checkpoint_resumes_from_the_previous_one(tmp_path, small_data, reference, reference_dir):
    args = micro_overrides(tmp_path, small_data, *RUN_ARGS)
    previous, newest = complete_checkpoints(_copy_run(reference_dir, tmp_path))
    _flip_byte(next(newest.glob("*.distcp")))
    r = run_cli(args)  # the finished run, launched again
    assert r.returncode == 0, r.stderr
    assert f"checkpoint {newest} is corrupt (__0_0.distcp does not match its sha256): resuming from {previous}" \
        in r.stdout
    assert _resumed_from(r) == MAX_STEPS - INTERVAL
    assert losses(tmp_path) == reference  # the steps after the previous checkpoint, trained again, bit for bit


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_line_and_the_run_resumes(tmp_path, small_data, reference, reference_dir):
    args = micro_overrides(tmp_path, small_data, *RUN_ARGS)
    ckpts = _copy_run(reference_dir, tmp_path)
    shutil.rmtree(ckpts / "step_00000024")  # as if the run were at step 21
    r = run_faulty(f"enospc_in_save={MAX_STEPS}", args)
    assert r.returncode == 4
    assert r.stderr.strip().splitlines() == [
        f"error: saving checkpoint step {MAX_STEPS} failed: no space left on device "
        f"({ckpts / '.tmp_step_00000024'}); the previous checkpoint {ckpts / 'step_00000021'} stays the one a resume "
        "starts from"]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000021"]  # no partial directory left
    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    assert _resumed_from(r) == MAX_STEPS - INTERVAL and losses(tmp_path) == reference


@pytest.mark.slow
def test_sigterm_saves_exits_zero_and_resumes_exactly(tmp_path, small_data, reference):
    args = micro_overrides(tmp_path, small_data, *RUN_ARGS)
    proc = subprocess.Popen([sys.executable, "-m", "trainer.cli.main", *args], cwd=REPO, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if (tmp_path / "metrics.jsonl").exists() and len(read_metrics(tmp_path)) >= INTERVAL + 1:
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    match = re.search(rf"^stopped by SIGTERM at step (\d+)/{MAX_STEPS}: checkpoint saved at (\S+); launch again", out,
                      re.M)
    assert match, out
    stopped_at = int(match.group(1))
    assert stopped_at < MAX_STEPS, "the run finished before it could be stopped"
    assert complete_checkpoints(tmp_path / "checkpoints")[-1].name == f"step_{stopped_at:08d}"
    assert max(losses(tmp_path)) == stopped_at

    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    assert _resumed_from(r) == stopped_at
    assert losses(tmp_path) == reference  # bit for bit


@pytest.mark.slow
def test_a_resume_trains_with_the_configs_hyperparameters(tmp_path, small_data, reference_dir):
    args = micro_overrides(tmp_path, small_data, *RUN_ARGS)
    _copy_run(reference_dir, tmp_path)
    r = run_cli(args)  # the finished run, launched again
    assert r.returncode == 0, r.stderr
    assert (f"nothing to do: the run in {tmp_path} already reached trainer.max_steps={MAX_STEPS} (resumed at step "
            f"{MAX_STEPS})") in r.stdout
    changed = ["trainer.max_steps=26", "optim.lr=1e-3", "optim.weight_decay=0.01", "optim.schedule=constant",
               "optim.warmup_steps=0", "logger.progress_bar=true"]
    r = run_cli([*args, *changed])
    assert r.returncode == 0, r.stderr
    for key, old, new in (("optim.lr", 0.003, 0.001), ("optim.weight_decay", 0.1, 0.01),
                          ("optim.schedule", "cosine", "constant"), ("optim.warmup_steps", 30, 0),
                          ("trainer.max_steps", MAX_STEPS, 26)):
        assert f"resume: {key} changed from {old!r} (checkpoint) to {new!r} (config)" in r.stdout
    assert [row["lr"] for row in read_metrics(tmp_path)][MAX_STEPS:] == [1e-3, 1e-3]  # the config's, not 3e-3's
    # the bar asked for, but no terminal (a log file): one plain line per logged step, MFU and ETA included
    assert re.search(r"step 26/26 \| loss \d+\.\d{4} \| lr 1\.000e-03 \| [\d,]+ tok/s \| MFU \d+\.\d\d% \| ETA 0m00s",
                     r.stdout), r.stdout


# --- layouts: what a checkpoint carries from one layout to another ---------------------------------------------------


def test_data_position_follows_the_data_rank_and_rng_stays_per_rank(tmp_path):
    model, opt, sched, loader, states = _toy(0)
    _train_steps(model, opt, sched, 1)
    loader.position = 11
    ckpt = Checkpointer(tmp_path, CheckpointConfig())
    path = ckpt.save(1, states)  # one process: global rank 0, data rank 0

    # A tensor-parallel peer (global rank 1) that reads data rank 0's batches: the position comes back; its own RNG
    # state was never saved, so its fresh state stays.
    _, _, _, loader2, states2 = _toy(1)
    states2["rank_local"] = RankLocalState(loader2, rank=1, data_rank=0)
    torch.manual_seed(123)
    fresh = torch.get_rng_state()
    ckpt.load(path, states2)
    assert loader2.position == 11 and torch.equal(torch.get_rng_state(), fresh)

    # A second data rank has no position to resume: refused, saying what to do.
    _, _, _, loader3, states3 = _toy(1)
    states3["rank_local"] = RankLocalState(loader3, rank=1, data_rank=1)
    with pytest.raises(ValueError, match=r"no data position for data rank 1 \(it has 1 data ranks.*"
                                         r"checkpoint.resume=none"):
        ckpt.load(path, states3)


class _Format1State:
    """The rank-local Stateful of checkpoint format 1: data position and RNG in one blob under rank<r>."""

    def __init__(self, loader):
        self.loader = loader

    def state_dict(self):
        return {"rank0": pickle.dumps({"data": self.loader.state_dict(), "rng": _rng_state()})}

    def load_state_dict(self, state):  # (DCP treats only objects with both methods as Stateful)
        raise AssertionError("only saved here")


def test_format_1_checkpoints_still_load(tmp_path):
    model, opt, sched, loader, states = _toy(0)
    _train_steps(model, opt, sched, 2)
    loader.position = 5
    states["train"].step = 2
    torch.manual_seed(77)
    expected_rng = torch.get_rng_state()
    path = Checkpointer(tmp_path, CheckpointConfig()).save(2, {"train": states["train"],
                                                               "rank_local": _Format1State(loader)})
    (path / COMPLETE_MARKER).write_text(json.dumps({"format": 1, "step": 2, "saved_at": 0.0}))  # as format 1 wrote it

    model2, opt2, sched2, loader2, states2 = _toy(1)
    ckpt = Checkpointer(tmp_path, CheckpointConfig())
    ckpt.check_model(path, ModelConfig())  # no model recorded: nothing to check
    torch.manual_seed(0)
    ckpt.load(path, states2)
    assert states2["train"].step == 2 and loader2.position == 5
    assert torch.equal(torch.get_rng_state(), expected_rng)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_a_model_that_changes_parameters_is_refused_naming_the_keys(tmp_path):
    model, opt, sched, loader, states = _toy(0)
    _train_steps(model, opt, sched, 1)
    saved = ModelConfig(dim=256, num_layers=40)
    ckpt = Checkpointer(tmp_path, CheckpointConfig(), info={"model": dataclasses.asdict(saved)})
    path = ckpt.save(1, states)
    assert json.loads((path / COMPLETE_MARKER).read_text())["model"]["dim"] == 256
    # switches that leave every parameter as it is may change
    ckpt.check_model(path, dataclasses.replace(saved, kernels="reference", quant=dataclasses.replace(
        saved.quant, main_kv="fp4"), moe=dataclasses.replace(saved.moe, bias_update_rate=0.5)))
    other = dataclasses.replace(saved, dim=512, moe=dataclasses.replace(saved.moe, num_experts=64))
    with pytest.raises(ValueError) as e:
        ckpt.check_model(path, other)
    assert str(e.value) == (
        f"checkpoint {path} was saved with another model: model.dim=256 there, 512 here; model.moe.num_experts=384 "
        "there, 64 here. Resume with the checkpoint's values (model.dim=256 model.moe.num_experts=384) or start fresh "
        "with checkpoint.resume=none")
    assert [k for k, _, _ in model_config_differences(dataclasses.asdict(saved), dataclasses.asdict(other))] == [
        "dim", "moe.num_experts"]
    # a checkpoint older than a config section (dspark, vision) or key holds no part it describes: no difference
    older = {k: v for k, v in dataclasses.asdict(saved).items() if k not in ("dspark", "vision")}
    del older["moe"]["swiglu_limit"]
    assert model_config_differences(older, dataclasses.asdict(saved)) == []
    assert [k for k, _, _ in model_config_differences(older, dataclasses.asdict(other))] == ["dim", "moe.num_experts"]
