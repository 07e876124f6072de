"""One launch per run directory: rank 0 takes the lock, a second launch is refused in one line naming the holder and
writes nothing into the directory (not even Hydra's .hydra/config.yaml); a lock whose holder died on this host, or
whose heartbeat stopped, is taken over with a warning; ranks of the launch that holds it pass, ranks of another
launch are refused; rank 0 of a requeued launch (same launch id) takes over its own lock; the lock is gone after a run ends; an unwritable run directory is refused in one line."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer.harness import REPO, env, micro_overrides, run_cli
from trainer.run_lock import LOCK_NAME, STALE_S, RunDirLocked, RunLock, launch_id


def _write_lock(run_dir: Path, pid: int, host: str | None = None, launch: str = "", age: float = 0.0) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    path.write_text(json.dumps({"host": host or socket.gethostname(), "pid": pid, "launch": launch,
                                "started": time.time() - age}))
    if age:
        os.utime(path, (time.time() - age, time.time() - age))
    return path


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_live_holder_refuses_the_second_launch(tmp_path, monkeypatch):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(tmp_path, sleeper.pid)
        with pytest.raises(RunDirLocked, match=rf"in use by another launch \(pid {sleeper.pid} on host"):
            RunLock.acquire(tmp_path / ".", rank=0)
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-launch")
        with pytest.raises(RunDirLocked):  # a rank of another launch too
            RunLock.acquire(tmp_path, rank=1)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_dead_holder_or_a_stopped_heartbeat_is_taken_over(tmp_path, caplog):
    for run_dir, holder in ((tmp_path / "dead", {"pid": _dead_pid()}),
                            (tmp_path / "silent", {"pid": 1, "host": "another-node", "age": STALE_S + 5})):
        _write_lock(run_dir, **holder)
        with caplog.at_level("WARNING"):
            lock = RunLock.acquire(run_dir, rank=0)
        assert "taking over the stale lock" in caplog.text
        assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == os.getpid()
        lock.release()
        assert not (run_dir / LOCK_NAME).exists()


def test_a_requeued_launch_takes_over_its_own_lock(tmp_path, monkeypatch):
    # a Slurm requeue on other nodes: the old rank 0's host cannot be checked and its heartbeat is fresh, but the
    # lock carries this launch's id (the job id), so its holder is this launch's earlier incarnation
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "4242")
    _write_lock(tmp_path, 1, host="node-that-died", launch=launch_id())
    lock = RunLock.acquire(tmp_path, rank=0)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()


def test_ranks_of_the_holding_launch_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(tmp_path, sleeper.pid, launch=launch_id())
        assert RunLock.acquire(tmp_path, rank=1) is None
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
        with pytest.raises(RunDirLocked):
            RunLock.acquire(tmp_path, rank=1)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_cli_refuses_a_second_launch_and_leaves_the_first_ones_record(tmp_path, small_data):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from trainer.run_lock import RunLock; "
         f"RunLock.acquire({str(tmp_path)!r}); print('held', flush=True); time.sleep(120)"],
        cwd=REPO, env=env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        r = run_cli(micro_overrides(tmp_path, small_data, "trainer.max_steps=2"))
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"error: run directory {tmp_path} is in use by another launch (pid {holder.pid} on host")
    assert not (tmp_path / ".hydra").exists() and not (tmp_path / "metrics.jsonl").exists()

    r = run_cli(micro_overrides(tmp_path, small_data, "trainer.max_steps=2"))  # the holder is dead: taken over
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / LOCK_NAME).exists()  # released at the end


def _read_only_dir(tmp_path: Path):
    """A directory that even root cannot write: a read-only tmpfs where mounting is allowed, else sysfs."""
    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(mount)], capture_output=True).returncode == 0:
        return mount / "run", "Read-only file system", lambda: subprocess.run(["umount", str(mount)])
    return Path("/sys/cedar-test-run"), "Operation not permitted", lambda: None


def test_an_unwritable_run_directory_is_refused_in_one_line(tmp_path, small_data):
    run_dir, reason, cleanup = _read_only_dir(tmp_path)
    try:
        r = run_cli(micro_overrides(run_dir, small_data, "trainer.max_steps=2"))
    finally:
        cleanup()
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"error: hydra.run.dir={str(run_dir)!r} is not writable: {reason}"]
