"""trainer/cli/torchrun.py, torchrun as the launchers run it: a failed rank's own exit status and no traceback (a
rank killed by a signal: 128 + N and one line), workers started with the stop signals blocked, a SIGTERM to torchrun
passed on to its workers, which save and exit 0; also when every process of the job gets it at once (Slurm's
proctrack/linuxproc on scancel), so that each rank sees it twice."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from tests.trainer.harness import REPO, env, micro_overrides, read_metrics
from trainer.checkpoint import complete_checkpoints
from trainer.cli.torchrun import children, exit_status

TORCHRUN_SH = REPO / "launch" / "torchrun.sh"


def _failure(exitcode: int) -> ChildFailedError:
    return ChildFailedError("trainer.cli.main", {1: ProcessFailure(local_rank=1, pid=4242, exitcode=exitcode,
                                                                   error_file="")})


@pytest.mark.parametrize("exitcode, expected", [
    (2, (2, None)),  # the rank printed its one line itself
    (4, (4, None)),
    (-9, (137, "error: rank 1 was killed by SIGKILL")),
    (-15, (143, "error: rank 1 was killed by SIGTERM")),
])
def test_exit_status_is_the_failed_ranks(exitcode, expected):
    assert exit_status(_failure(exitcode)) == expected


def test_children_finds_a_child_and_nothing_else():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert proc.pid in children(os.getpid())
        assert children(proc.pid) == []
    finally:
        proc.kill()
        proc.wait()


def test_workers_start_with_the_stop_signals_blocked():
    # torchrun's own start-up, up to its workers, in a child: main() blocks the signals in this (test) process
    program = (
        "import subprocess, sys\n"
        "from trainer.cli import torchrun\n"
        "import torch.distributed.run as tr\n"
        "def fake_run(args):\n"
        "    print(subprocess.run(['grep', 'SigBlk', '/proc/self/status'], capture_output=True, text=True).stdout)\n"
        "tr.run = fake_run\n"
        "torchrun.main(['--nproc_per_node=1', '-m', 'trainer.cli.main'])\n"
    )
    r = subprocess.run([sys.executable, "-c", program], cwd=REPO, env=env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    blocked = int(r.stdout.split()[1], 16)
    assert blocked & (1 << (signal.SIGTERM - 1)) and blocked & (1 << (signal.SIGUSR1 - 1)), r.stdout


def _launch(tmp_path, data, *extra):
    return subprocess.Popen([str(TORCHRUN_SH), "1", *micro_overrides(tmp_path, data, *extra)], cwd=REPO, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.slow
def test_an_error_the_preflight_misses_is_the_ranks_line_and_status(tmp_path, small_data):
    proc = _launch(tmp_path, small_data, "data.path=/nonexistent/cedar-data", "data.auto_prepare=false")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: data.path='/nonexistent/cedar-data' does not exist"), err


@pytest.mark.slow
def test_an_error_of_every_rank_is_one_line(tmp_path, small_data):
    """Two ranks that fail alike (issue 44, from a fresh clone: torchrun's four-line OMP_NUM_THREADS warning, the
    error once per rank, torchrun's 'Sending process N closing signal SIGTERM'): one line, the ranks' status."""
    proc = subprocess.Popen([str(TORCHRUN_SH), "2", *micro_overrides(tmp_path, small_data, "data.num_workers=0",
                                                                     "data.path=/nonexistent/cedar-data",
                                                                     "data.auto_prepare=false")],
                            cwd=REPO, env={k: v for k, v in env().items() if k != "OMP_NUM_THREADS"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: data.path='/nonexistent/cedar-data' does not exist"), err


@pytest.mark.slow
def test_sigterm_to_torchrun_and_its_worker_at_once_still_saves(tmp_path, small_data):
    proc = _launch(tmp_path, small_data, "trainer.max_steps=100000", "optim.schedule=constant",
                   "optim.warmup_steps=0", "checkpoint.interval=100000")
    try:
        deadline = time.monotonic() + 240
        while not ((tmp_path / "metrics.jsonl").exists() and read_metrics(tmp_path)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        workers = children(proc.pid)  # torchrun.sh exec'd torchrun: proc.pid is torchrun
        assert len(workers) == 1, workers
        for pid in [proc.pid, *workers]:  # as proctrack/linuxproc delivers scancel's SIGTERM
            os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "second SIGTERM" not in err
    match = re.search(r"^stopped by SIGTERM at step (\d+)/100000", out, re.M)
    assert match, out[-3000:]
    (ckpt,) = complete_checkpoints(tmp_path / "checkpoints")
    assert ckpt.name == f"step_{int(match.group(1)):08d}"


def test_a_stop_in_the_rendezvous_exits_143_in_one_line(tmp_path):
    # a 2-node rendezvous whose second node never comes: torchrun waits in it with no worker
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "trainer.cli.torchrun", "--nnodes=2", "--nproc_per_node=1",
                             "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=cedar-test",
                             "-m", "trainer.cli.main"], cwd=REPO, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _listening(port):  # the rendezvous store is up: torchrun is waiting in it
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "error: SIGTERM before any rank started: exiting", err


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
