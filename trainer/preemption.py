"""Stopping on a signal: a Slurm preemption or time limit (SIGTERM, or SIGUSR1 with `--signal=USR1@...`) ends the run
after the step in flight, with a checkpoint, on every rank alike.

Contract: `StopRequest(deadline_s).install()` handles `STOP_SIGNALS` (main thread only; elsewhere a no-op) and then
unblocks them, so a stop a launcher kept pending is handled now; the handler only records the signal.
`agreed(distributed)`, asked by the loop after every optimiser step, is True on every rank once any rank has one
(a MAX all-reduce over the world when `distributed`). A second signal of the same kind more than
`duplicate_window_s` after the first exits at once (128 + signal, one line); one within it, or the other stop
signal, is the same stop and is ignored. If the process still runs `deadline_s` (> 0) after the first signal, it
exits with status 143 and one line. `uninstall` puts the previous handlers back.

Design and reasoning: docs/training.md#stopping-on-a-signal
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
