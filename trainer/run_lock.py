"""One launch per run directory: a lock file `<run dir>/.cedar.lock` held by global rank 0 while the job runs.

Contract: `RunLock.acquire` creates the lock atomically (O_CREAT | O_EXCL) with its holder (host, pid, `launch_id`,
a heartbeat a thread refreshes) and removes it at exit; a lock whose holder cannot be running (pid gone on this
host, heartbeat older than `STALE_S`, or this launch's own earlier incarnation) is taken over with a warning; any
other raises `RunDirLocked`, so a refused launch writes nothing into the directory. The other ranks of the holding
launch pass. The Hydra callback `RunDirLock` takes it before Hydra writes `.hydra/`; `acquire` is idempotent within
a process. `check_writable` refuses a run directory that cannot be written.

Design and reasoning: docs/training.md#one-launch-per-run-directory
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import socket
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_NAME = ".cedar.lock"
HEARTBEAT_S = 10.0
STALE_S = 60.0


class RunDirLocked(ValueError):
    """Another live launch holds the run directory (a ValueError: the entry point prints it as one line)."""


def launch_id() -> str:
    """An id every rank of one launch shares and another launch does not ('' for a plain single process)."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return "torchrun:" + os.environ["TORCHELASTIC_RUN_ID"]
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm:{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', '')}"
    return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _describe(holder: dict, age: float) -> str:
    return (f"pid {holder.get('pid')} on host {holder.get('host')!r}, started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder.get('started', 0)))}, last heartbeat "
            f"{age:.0f} s ago")


class RunLock:
    """The lock of one run directory, held by this process (rank 0) until `release()` or exit."""

    _held: dict[Path, RunLock] = {}

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.created_dir = False  # this launch created the run directory (RunDirLock): `discard_dir` may remove it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, run_dir: Path, rank: int = 0) -> RunLock | None:
        """Rank 0: take the lock (RunDirLocked if a live launch holds it). Other ranks: check only that no other
        launch holds it. Idempotent within a process."""
        run_dir = Path(run_dir).resolve()
        if run_dir in cls._held:
            return cls._held[run_dir]
        lock = cls(run_dir)
        if rank != 0:
            holder, age = lock._read()
            if holder is not None and holder.get("launch") != launch_id() and not lock._stale(holder, age):
                raise RunDirLocked(lock._refusal(holder, age))
            return None
        lock._take()
        cls._held[run_dir] = lock
        return lock

    @classmethod
    def release_dir(cls, run_dir: Path) -> None:
        """Release this process's lock of `run_dir`, if it holds one (the end of a job; atexit covers the rest)."""
        lock = cls._held.get(Path(run_dir).resolve())
        if lock is not None:
            lock.release()

    @classmethod
    def discard_dir(cls, run_dir: Path) -> None:
        """A launch that failed at start-up: release this process's lock of `run_dir` and, if this launch created the
        directory, remove it (it holds only what the start-up wrote: Hydra's `.hydra/`, an empty main.log), so a
        failed launch leaves no run directory behind. A directory that existed before (a relaunch) is kept."""
        run_dir = Path(run_dir).resolve()
        lock = cls._held.get(run_dir)
        if lock is None:
            return
        lock.release()
        if lock.created_dir:
            shutil.rmtree(run_dir, ignore_errors=True)

    def _read(self) -> tuple[dict | None, float]:
        try:
            age = time.time() - self.path.stat().st_mtime
            return json.loads(self.path.read_text() or "{}"), age
        except FileNotFoundError:
            return None, 0.0
        except ValueError:  # a half-written lock (its writer died between create and write): judged by age alone
            return {}, age

    @staticmethod
    def _stale(holder: dict, age: float) -> bool:
        if age > STALE_S:
            return True
        same_host = holder.get("host") == socket.gethostname()
        return same_host and isinstance(holder.get("pid"), int) and not _pid_alive(holder["pid"])

    def _refusal(self, holder: dict, age: float) -> str:
        return (f"run directory {self.path.parent} is in use by another launch ({_describe(holder, age)}): wait for "
                f"it to finish, stop it, or pick another hydra.run.dir (lock file {self.path})")

    def _take(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "launch": launch_id(), "started": time.time()}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder, age = self._read()
                if holder is None:  # released meanwhile
                    continue
                earlier_self = bool(launch_id()) and holder.get("launch") == launch_id()
                if not (earlier_self or self._stale(holder, age)):
                    raise RunDirLocked(self._refusal(holder, age)) from None
                log.warning("taking over the stale lock of run directory %s (%s)", self.path.parent,
                            _describe(holder, age))
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            break
        else:
            raise RunDirLocked(f"could not take the lock {self.path}: it keeps reappearing (another launch?)")
        self._thread = threading.Thread(target=self._beat, name="cedar-run-lock", daemon=True)
        self._thread.start()
        atexit.register(self.release)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:  # removed under us; nothing to keep alive
                return

    def release(self) -> None:
        self._stop.set()
        RunLock._held.pop(self.path.parent, None)
        try:
            holder = json.loads(self.path.read_text())
            if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                self.path.unlink()
        except (OSError, ValueError):
            pass


def _global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def check_writable(run_dir: Path) -> None:
    """ValueError naming hydra.run.dir when the run directory cannot be created or written."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write_probe_{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"hydra.run.dir={str(run_dir)!r} is not writable: {e.strerror or e}") from None


try:
    from hydra.experimental.callback import Callback
except ImportError:  # hydra is a dependency; this keeps the module importable without it
    Callback = object


class RunDirLock(Callback):
    """Hydra callback: before Hydra writes anything into the run directory, check that it is writable and take its
    lock (rank 0) or check it (other ranks); a refusal exits with status 2 and one line."""

    def on_run_start(self, config, **kwargs) -> None:
        import sys

        run_dir = Path(str(config.hydra.run.dir))
        created = not run_dir.exists()
        try:
            check_writable(run_dir)
            lock = RunLock.acquire(run_dir, _global_rank())
            if lock is not None:
                lock.created_dir = created
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
