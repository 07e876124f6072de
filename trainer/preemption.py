"""Stopping on a signal: a Slurm preemption or time limit (SIGTERM, or SIGUSR1 with `--signal=USR1@...`) ends the run
after the step in flight, with a checkpoint, on every rank alike.

The handler only records the signal. The loop asks `StopRequest.agreed()` after every optimiser step: under
torchrun the signal can reach one rank before the others (or only one rank, when a user signals one process), so
the ranks take the maximum of their flags (one tiny all-reduce over the world, on the CPU group) and all stop at the
same step. A deadline bounds the whole thing: if the process has not exited `deadline_s` after the first signal (a
step or a save that hangs), it exits with status 143 and one line; checkpoints are atomic, so the newest complete
one is still the one a resume starts from.

A second signal of the same kind more than `duplicate_window_s` after the first exits at once: the user means it.
One within that window is the same stop delivered twice, not a second request: under Slurm's `proctrack/linuxproc`,
`scancel` and `scontrol requeue` signal every process of the step, so a rank gets Slurm's SIGTERM and, a moment
later, the one its launcher passes on (launch/README.md, "Time limits, preemption and requeue").

Launchers start the ranks with the stop signals blocked (trainer/cli/torchrun.py): a stop that comes while a rank
imports and sets up stays pending until `install` unblocks it, and is then handled, instead of killing the rank.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# seconds within which a second signal of the same kind is the first one delivered again (by the process tracker
# and by a launcher), not a user asking twice
DUPLICATE_WINDOW_S = 5.0


class StopRequest:
    def __init__(self, deadline_s: float, duplicate_window_s: float = DUPLICATE_WINDOW_S) -> None:
        self.deadline_s = deadline_s
        self.duplicate_window_s = duplicate_window_s
        self.signal: int | None = None
        self.received_at: float | None = None
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else "a peer rank's signal"

    def install(self) -> StopRequest:
        """Handle the stop signals, then unblock them: one a launcher kept pending is handled now (main thread only;
        elsewhere, e.g. under a test runner thread, a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._timer is not None:
            self._timer.cancel()

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:
            if signum != self.signal:  # the other stop signal (e.g. Slurm's and a launcher's): the same request
                return
            if time.monotonic() - self.received_at < self.duplicate_window_s:  # the tracker's and the launcher's copy
                return
            # asked twice: the user (or the scheduler) means it
            os.write(2, f"error: second {signal.Signals(signum).name}: exiting without a checkpoint\n".encode())
            os._exit(128 + signum)
        self.signal, self.received_at = signum, time.monotonic()
        if self.deadline_s > 0:
            self._timer = threading.Timer(self.deadline_s, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def _expire(self) -> None:
        os.write(2, (f"error: still running {self.deadline_s:g} s after {self.name} (trainer.stop_deadline_s): "
                     "exiting; the newest complete checkpoint is the one a resume starts from\n").encode())
        sys.stderr.flush()
        os._exit(143)

    def agreed(self, distributed: bool) -> bool:
        """True on every rank when any rank received a stop signal (a collective when `distributed`)."""
        local = self.signal is not None
        if not distributed:
            return local
        flag = torch.tensor([1.0 if local else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
