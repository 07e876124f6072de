"""Preemption (one process: tests/trainer/test_checkpoint.py, a SIGTERM'd run saves, exits 0 and resumes bit for
bit): under torchrun a signal that reaches one rank only stops both ranks at the same step, each saving its shard. A stop that
hangs past trainer.stop_deadline_s exits 143 with one line; a second signal exits at once, unless it comes within
the duplicate window (the process tracker's copy of the same stop, as under Slurm's proctrack/linuxproc). A signal
that came while the stop signals were blocked (a launcher starts ranks so) is handled once the handler is
installed."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer.harness import REPO, env, losses, micro_overrides, read_metrics, run_cli
from trainer.checkpoint import complete_checkpoints

# a constant lr: the schedule does not depend on trainer.max_steps, so a stopped and resumed run can be compared with
# an uninterrupted one of a different length
CONSTANT = ["optim.schedule=constant", "optim.warmup_steps=0", "checkpoint.interval=1000"]


def _wait_for_steps(proc, run_dir: Path, steps: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= steps:
            return
        time.sleep(0.01)
    raise AssertionError(f"the run did not reach step {steps} (exit status {proc.poll()})")


def _worker_pids(run_dir: Path) -> dict[int, int]:
    """{global rank: pid} of the trainer processes writing into run_dir."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = dict(v.split(b"=", 1) for v in (entry / "environ").read_bytes().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if b"trainer.cli.main" in cmdline and f"hydra.run.dir={run_dir}".encode() in cmdline and b"RANK" in environ:
            found[int(environ[b"RANK"])] = int(entry.name)
    return found


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, small_data):
    args = micro_overrides(tmp_path, small_data, "trainer.max_steps=500", *CONSTANT)
    proc = subprocess.Popen([str(REPO / "launch" / "torchrun.sh"), "2", *args], cwd=REPO, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_steps(proc, tmp_path, 2)
        pids = _worker_pids(tmp_path)
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[1], signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    match = re.search(r"^stopped by a peer rank's signal at step (\d+)/500", out, re.M)
    assert match, out[-3000:]
    (ckpt,) = complete_checkpoints(tmp_path / "checkpoints")
    assert ckpt.name == f"step_{int(match.group(1)):08d}"
    assert sorted(f.name for f in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def _stop_request_program(deadline: float, signals: int, gap_s: float, window_s: float = 0.5) -> str:
    return (
        "import os, signal, time\n"
        "from trainer.preemption import StopRequest\n"
        f"stop = StopRequest({deadline}, duplicate_window_s={window_s}).install()\n"
        f"for _ in range({signals}):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        f"    time.sleep({gap_s})\n"
        "print('still running after', stop.name, flush=True)\n"
    )


@pytest.mark.parametrize("deadline, signals, message", [
    (0.5, 1, "error: still running 0.5 s after SIGTERM (trainer.stop_deadline_s): exiting"),
    (60, 2, "error: second SIGTERM: exiting without a checkpoint"),
])
def test_a_stop_that_does_not_finish_exits_143(deadline, signals, message):
    t0 = time.monotonic()
    # signals 1 s apart, outside the 0.5 s duplicate window
    r = subprocess.run([sys.executable, "-c", _stop_request_program(deadline, signals, gap_s=1)], cwd=REPO,
                       env=env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 143 and time.monotonic() - t0 < 20
    assert r.stderr.strip().splitlines()[-1].startswith(message), r.stderr


def test_a_second_signal_within_the_window_is_the_same_stop():
    # three copies 0.05 s apart (Slurm's, the node task's, torchrun's), a 60 s deadline: no exit, one stop
    r = subprocess.run([sys.executable, "-c", _stop_request_program(60, 3, gap_s=0.05, window_s=5)], cwd=REPO,
                       env=env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "still running after SIGTERM"


def test_a_signal_blocked_before_the_handler_is_handled_at_install():
    program = (
        "import os, signal\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})  # as trainer/cli/torchrun.py\n"
        "os.kill(os.getpid(), signal.SIGTERM)  # pending: not delivered, not lost\n"
        "from trainer.preemption import StopRequest\n"
        "stop = StopRequest(60).install()\n"
        "print(stop.name, signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []), flush=True)\n"
    )
    r = subprocess.run([sys.executable, "-c", program], cwd=REPO, env=env(), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "SIGTERM False"  # handled, and unblocked


@pytest.mark.slow
def test_a_stop_sent_before_the_trainer_starts_ends_it_after_one_step_with_a_checkpoint(tmp_path, small_data):
    # As trainer/cli/torchrun.py starts its ranks: the stop signals blocked. The SIGTERM comes before the trainer has
    # run a line (a launcher's stop while the rank imports); it stays pending until the trainer installs its handler
    # (and unblocks it), and the run stops after its first step.
    args = micro_overrides(tmp_path, small_data, "trainer.max_steps=500", *CONSTANT)
    program = (
        "import os, signal, subprocess, sys\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})\n"
        f"p = subprocess.Popen([sys.executable, '-m', 'trainer.cli.main', *{args!r}])\n"
        "os.kill(p.pid, signal.SIGTERM)\n"
        "sys.exit(p.wait())\n"
    )
    r = subprocess.run([sys.executable, "-c", program], cwd=REPO, env=env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"^stopped by SIGTERM at step 1/500", r.stdout, re.M), r.stdout[-3000:]
    (ckpt,) = complete_checkpoints(tmp_path / "checkpoints")
    assert ckpt.name == "step_00000001"
