"""The training loop end to end through the CLI, on a micro V4.1 model: the loss falls, every logged step carries
the promised metrics (metrics.jsonl and the offline W&B run inside the run directory agree), checkpoints land under
<run dir>/checkpoints/; gradient accumulation equals the larger batch; two gloo processes launched by
launch/torchrun.sh reproduce the single-process run (same data, same losses and gradient norms); a step with a NaN
loss or gradient norm is skipped (no update: the optimiser's step count proves it), counted in the metrics, and
trainer.max_bad_steps of them in a row stop the run with a one-line error, saving nothing of the diverged steps; the
progress bar shows MFU on a terminal (tests/trainer/test_checkpoint.py: a resume's hyperparameters and the plain
progress lines without one); the stage hooks set up or refuse their
switches; only the parameters the optimiser owns get gradients; a 2-rank torchrun job whose rank 1 is killed fails
within the collective timeout, and one whose rank 1 hangs (SIGSTOP) has rank 0 raise a timeout error after
parallel.timeout_s instead of waiting forever."""

import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.trainer.harness import (
    REPO, env, losses, micro_overrides, read_metrics, run_cli, run_faulty, side_by_side, wandb_history,
)
from tests.trainer.test_stage import expected_probe
from trainer.checkpoint import Checkpointer, complete_checkpoints
from trainer.train import freeze_all_but

METRIC_KEYS = {
    "step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_seen", "mfu", "expert_imbalance", "memory_mb",
    "skipped_shards", "skipped_steps", "aux/indexer_kl", "aux_metric/indexer_kl",
}


@pytest.mark.slow
def test_short_run_learns_and_logs(tmp_path, small_data):
    steps = 40
    args = micro_overrides(
        tmp_path, small_data, f"trainer.max_steps={steps}", "optim.lr=1e-2", "optim.warmup_steps=5",
        "checkpoint.interval=20", "logger.wandb.mode=offline",
    )
    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    for row in rows:
        assert METRIC_KEYS <= row.keys(), METRIC_KEYS - row.keys()
        assert all(math.isfinite(v) for v in row.values())
    assert rows[-1]["tokens_seen"] == steps * 4 * 32  # batch 4 x seq_len 32 per step
    first, last = [r["loss"] for r in rows[:5]], [r["loss"] for r in rows[-5:]]
    assert sum(last) / 5 < sum(first) / 5 - 0.7, (first, last)

    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step_00000020", "step_00000040"]
    assert f"run directory: {tmp_path}" in r.stdout and "W&B files:" in r.stdout

    # the offline W&B run lives in the run directory and holds the same numbers
    (wandb_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history = wandb_history(wandb_file)
    assert [h["_step"] for h in history] == list(range(1, steps + 1))
    assert [h["loss"] for h in history] == [row["loss"] for row in rows]
    assert history[-1]["lr"] == rows[-1]["lr"]


@pytest.mark.slow
def test_grad_accumulation_equals_the_larger_batch(tmp_path, small_data):
    # the loader cuts rows from one stream in order: 2 micro-batches of 2 rows = 1 batch of 4 rows
    common = ["trainer.max_steps=4", "checkpoint.interval=0", "checkpoint.save_final=false"]
    big, acc = side_by_side(
        lambda: run_cli(micro_overrides(tmp_path / "big", small_data, *common)),
        lambda: run_cli(micro_overrides(tmp_path / "acc", small_data, *common, "data.batch_size=2",
                                        "trainer.grad_accum=2")))
    assert big.returncode == 0 and acc.returncode == 0, big.stderr + acc.stderr
    a, b = read_metrics(tmp_path / "big"), read_metrics(tmp_path / "acc")
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)
        assert x["tokens_seen"] == y["tokens_seen"]


@pytest.mark.slow
@pytest.mark.distributed
def test_data_parallel_matches_single_process(tmp_path, small_data):
    # Two ranks, one reader each, vs one process whose two DataLoader workers are those same two readers
    # (batches alternate between them) accumulating over 2 micro-batches: identical data, mean gradient.
    common = ["trainer.max_steps=4", "checkpoint.interval=2"]
    args = micro_overrides(tmp_path / "dp", small_data, *common, "data.num_workers=0")
    single, dp = side_by_side(
        lambda: run_cli(micro_overrides(tmp_path / "single", small_data, *common, "data.num_workers=2",
                                        "trainer.grad_accum=2")),
        lambda: subprocess.run(["bash", str(REPO / "launch" / "torchrun.sh"), "2", *args], cwd=REPO, env=env(),
                               capture_output=True, text=True, timeout=300))
    assert single.returncode == 0, single.stderr
    assert dp.returncode == 0, dp.stderr[-3000:]
    a, b = read_metrics(tmp_path / "single"), read_metrics(tmp_path / "dp")
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-4)
        assert x["tokens_seen"] == y["tokens_seen"]
    # both ranks wrote their shard of the checkpoint into one directory
    last = complete_checkpoints(tmp_path / "dp" / "checkpoints")[-1]
    assert sorted(f.name for f in last.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.slow
def test_nan_loss_stops_with_a_clear_error(tmp_path, small_data):
    # lr 1e30 throws every weight to ~1e30 after the first update; the next forward overflows
    args = micro_overrides(tmp_path, small_data, "trainer.max_steps=10", "checkpoint.interval=1",
                           "optim.lr=1e30", "optim.warmup_steps=0", "trainer.grad_clip=0", "trainer.max_bad_steps=1")
    r = run_cli(args)
    assert r.returncode == 3
    last = r.stderr.strip().splitlines()[-1]
    match = re.fullmatch(r"error: training diverged: loss is (nan|inf) at step (\d+): 1 non-finite .*", last)
    assert match, r.stderr
    assert "Traceback" not in r.stderr
    bad_step = int(match.group(2))
    saved = [int(p.name.split("_")[1]) for p in complete_checkpoints(tmp_path / "checkpoints")]
    assert saved == list(range(1, bad_step))
    assert max(step for step, loss in losses(tmp_path).items() if loss is not None) == bad_step - 1


def _adam_steps(checkpoint: Path) -> int:
    """AdamW's step count of the first parameter in a checkpoint: the updates actually applied."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint), str(checkpoint.parent / "flat.pt"))
    flat = torch.load(checkpoint.parent / "flat.pt", weights_only=False)
    return int(next(v for k, v in flat["train"]["optim"]["state"].items())["step"])


@pytest.mark.slow
def test_non_finite_steps_are_skipped_and_counted(tmp_path, small_data):
    args = micro_overrides(tmp_path, small_data, "trainer.max_steps=8", "checkpoint.interval=0",
                           "trainer.callbacks=[tests.trainer.test_stage:Probe]")  # the callbacks' points, below
    r = run_faulty("nan_at=3,nan_grad_at=5+6", args)  # the loss at step 3, the gradient at steps 5 and 6
    assert r.returncode == 0, r.stderr
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == list(range(1, 9))
    probe = [json.loads(line) for line in (tmp_path / "probe.jsonl").read_text().splitlines()]
    assert probe == expected_probe(8, skipped={3, 5, 6}, checkpoints={8})
    assert [row["probe"] for row in rows] == list(range(1, 9))  # a callback's stats.extra reaches the metrics
    assert [row["loss"] is None for row in rows] == [False, False, True, False, False, False, False, False]
    assert [row["grad_norm"] is None for row in rows] == [False, False, True, False, True, True, False, False]
    assert [row["skipped_steps"] for row in rows] == [0, 0, 1, 1, 2, 3, 3, 3]
    assert "step 6 skipped: loss" in r.stdout and "(2 of trainer.max_bad_steps=3 in a row)" in r.stdout
    (final,) = complete_checkpoints(tmp_path / "checkpoints")
    assert _adam_steps(final) == 5  # 8 steps, 3 of them not applied
    assert Checkpointer.marker(final)["skipped_steps"] == 3


@pytest.mark.slow
def test_consecutive_bad_steps_stop_the_run_with_the_last_good_checkpoint(tmp_path, small_data):
    args = micro_overrides(tmp_path, small_data, "trainer.max_steps=8", "checkpoint.interval=1",
                           "trainer.max_bad_steps=2")
    r = run_faulty("nan_at=3+4", args)
    assert r.returncode == 3
    assert r.stderr.strip().splitlines() == [
        f"error: training diverged: loss is nan at step 3: 2 non-finite step(s) in a row (steps 3-4, "
        f"trainer.max_bad_steps=2), none of them applied or saved; the newest checkpoint of this launch is "
        f"{tmp_path / 'checkpoints' / 'step_00000002'}"]
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step_00000001", "step_00000002"]


def test_the_progress_bar_shows_mfu_on_a_terminal(monkeypatch, capsys):
    import sys

    from trainer.progress import Progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    progress = Progress(True, 0, 10, bar=True, log_every=1)
    progress.update(1, 2.5, 1e-3, 1234.0, 0.123)
    progress.bar.refresh()
    progress.close()
    assert "mfu=12.3%" in capsys.readouterr().err


def test_the_plain_progress_line_shows_the_stage_figures_and_an_eta_without_the_first_step(monkeypatch, caplog):
    """Issue 44: RL's line showed loss, lr and tokens/s but not its reward; a compiled run's first step (minutes of
    compiling) made the ETA hours."""
    from trainer import progress as progress_module

    clock = iter([0.0, 300.0, 301.0, 302.0])  # start; step 1 ends after 300 s (compiling); then 1 s a step
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: next(clock))
    progress = progress_module.Progress(True, 0, 10, bar=False, log_every=1)
    with caplog.at_level("INFO", logger="trainer.progress"):
        progress.update(1, 2.5, 1e-3, 10.0, None, {"rl/reward": 0.25, "rl/success": 0.125})
        progress.update(2, 2.4, 1e-3, 1000.0, None, {"rl/reward": 0.5, "rl/success": 0.25})
        progress.update(3, 2.3, 1e-3, 1000.0, None)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == ("step 1/10 | loss 2.5000 | rl/reward 0.25 | rl/success 0.125 | lr 1.000e-03 | 10 tok/s | "
                        "MFU ? | ETA 45m00s")
    assert lines[1].startswith("step 2/10 | loss 2.4000 | rl/reward 0.5 | rl/success 0.25 | lr")
    assert lines[1].endswith("ETA 0m08s")
    assert lines[2].endswith("ETA 0m07s")


def test_only_optimised_parameters_get_gradients():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    freeze_all_but(model, list(model[1].parameters()))  # like the indexer-only dense warm-up
    model(torch.randn(2, 3)).sum().backward()
    assert model[0].weight.grad is None and model[1].weight.grad is not None


# --- a dead or hung rank ------------------------------------------------------------------------------------------

TIMEOUT_S = 10


def _workers(agent_pid: int) -> dict[int, int]:
    """{RANK: pid} of the worker processes a torchrun agent started."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != agent_pid:
                continue
            environ = dict(kv.split("=", 1) for kv in (proc / "environ").read_bytes().decode().split("\0") if "=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in environ:
            found[int(environ["RANK"])] = int(proc.name)
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_two_ranks(tmp_path, small_data) -> tuple[subprocess.Popen, dict[int, int]]:
    """A 2-rank torchrun job with a short collective timeout, once it has logged a step."""
    args = micro_overrides(tmp_path, small_data, "trainer.max_steps=100000", "checkpoint.interval=0",
                           "checkpoint.save_final=false", f"parallel.timeout_s={TIMEOUT_S}")
    with open(tmp_path / "job.log", "w") as log:  # a file, not a pipe: nothing blocks on unread output
        job = subprocess.Popen(["bash", str(REPO / "launch" / "torchrun.sh"), "2", *args], cwd=REPO, env=env(),
                               stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and job.poll() is None:
        if (tmp_path / "metrics.jsonl").exists() and read_metrics(tmp_path):
            workers = _workers(job.pid)
            if len(workers) == 2:
                return job, workers
        time.sleep(0.2)
    job.kill()
    job.wait()
    raise AssertionError(f"the job did not start training: {(tmp_path / 'job.log').read_text()[-3000:]}")


@pytest.mark.slow
@pytest.mark.distributed
def test_a_killed_rank_fails_the_job_within_the_timeout(tmp_path, small_data):
    job, workers = _start_two_ranks(tmp_path, small_data)
    start = time.monotonic()
    os.kill(workers[1], signal.SIGKILL)
    try:
        job.wait(timeout=TIMEOUT_S + 30)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert time.monotonic() - start < TIMEOUT_S + 30
    assert not _alive(workers[0]), "rank 0 outlived the job"


@pytest.mark.slow
@pytest.mark.distributed
def test_a_hung_rank_makes_the_other_raise_after_the_timeout(tmp_path, small_data):
    # A stopped rank is not dead to torchrun, which would wait for it forever: only the collective timeout
    # (parallel.timeout_s) gets rank 0 out of the collective it waits in.
    job, workers = _start_two_ranks(tmp_path, small_data)
    start = time.monotonic()
    os.kill(workers[1], signal.SIGSTOP)
    try:
        deadline = start + TIMEOUT_S + 60
        while _alive(workers[0]) and time.monotonic() < deadline:
            time.sleep(0.2)
        waited = time.monotonic() - start
        assert not _alive(workers[0]), "rank 0 is still waiting on its stopped peer"
    finally:
        try:  # torchrun may have killed it already, once rank 0 failed
            os.kill(workers[1], signal.SIGKILL)
        except ProcessLookupError:
            pass
        if job.poll() is None:
            job.wait(timeout=60)
    output = (tmp_path / "job.log").read_text()
    assert job.returncode != 0
    assert waited >= TIMEOUT_S * 0.8, f"rank 0 exited after {waited:.1f} s, before the timeout"
    assert re.search(r"Timed out waiting \d+ms", output), output[-3000:]  # gloo's collective timeout
