"""`python -m trainer.cli.torchrun [torchrun options] -m trainer.cli.main [overrides]`: torchrun as the launchers
(launch/torchrun.sh, launch/slurm.sbatch) run it, with three changes a launch under a scheduler needs:

- Exit status: the first failed rank's own (2 for a bad configuration or a missing file, ...; 128 + N for a rank
  killed by signal N), not torchrun's 1, and no `ChildFailedError` traceback: the rank has said what went wrong in
  its own line; a rank killed by a signal gets one line here.
- SIGTERM and SIGUSR1 to torchrun are passed on to its workers, and torchrun goes on waiting for them: they finish
  their step, save a checkpoint and exit 0, and so does torchrun. torchrun's own handling would SIGTERM them, SIGKILL
  them after TORCH_ELASTIC_SHUTDOWN_TIMEOUT and exit 1 with a traceback. A stop before any worker runs (in the
  rendezvous) exits 128 + N with one line.
- The workers start with SIGTERM and SIGUSR1 blocked: a stop that comes while a worker imports and sets up stays
  pending until the trainer's handler is installed (trainer/preemption.py unblocks them), instead of killing it.

OMP_NUM_THREADS defaults to 1 as under torchrun, without its warning: each rank sets its threads itself."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

# The trainer's stop signals (trainer.preemption.STOP_SIGNALS; not imported from there, which imports torch).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class _RanksOwnReport(logging.Filter):
    """Drops torchrun's "failed (exitcode: N) local_rank: ..." line and its "Sending process N closing signal
    SIGTERM" to the other ranks after one failed: the rank has reported its error itself, and this module says what a
    rank killed by a signal cannot."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("failed (exitcode", "Sending process"))


def children(pid: int) -> list[int]:
    """The pids of the live processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ")"
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            found.append(int(entry))
    return found


def _pass_on() -> None:
    """Waits for the stop signals (blocked in every thread, so they come here) and sends each to the workers."""
    passed_on = False
    while True:
        sig = signal.sigwait(STOP_SIGNALS)
        workers = children(os.getpid())
        if not workers and passed_on:  # a late copy of the stop: the workers' exit statuses decide
            continue
        if not workers:  # still in the rendezvous: nothing to save
            os.write(2, f"error: {signal.Signals(sig).name} before any rank started: exiting\n".encode())
            os._exit(128 + sig)
        passed_on = True
        for pid in workers:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def exit_status(error: ChildFailedError) -> tuple[int, str | None]:
    """(the exit status to end with, a line to print or None) for the first failed rank: its own exit status (it
    printed its error itself), or 128 + N with a line when signal N killed it."""
    rank, failure = error.get_first_failure()
    if failure.exitcode >= 0:
        return failure.exitcode or 1, None
    name = signal.Signals(-failure.exitcode).name
    return 128 - failure.exitcode, f"error: rank {rank} was killed by {name}"


def main(argv: list[str] | None = None) -> None:
    # Blocked before anything starts a thread: every thread of this process and every worker it starts inherits the
    # mask, so the signals reach this process only through `_pass_on`'s sigwait, and a worker only once its handler
    # is installed. Hence torch is imported here, after it: importing torch starts a thread.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    # What torchrun does for several workers anyway, without its four-line warning to tune OMP_NUM_THREADS: each
    # rank then sets its own thread count (trainer.num_threads, trainer/threads.py: the cores over the local ranks).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # torchrun would install its own handler for SIGTERM (raising in its main loop); the thread above handles it
    args.signals_to_handle = ",".join(s for s in args.signals_to_handle.split(",")
                                      if s.strip() not in ("SIGTERM", "SIGUSR1"))
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_RanksOwnReport())
    threading.Thread(target=_pass_on, name="cedar-stop", daemon=True).start()
    try:
        run(args)
    except ChildFailedError as e:
        code, line = exit_status(e)
        if line:
            print(line, file=sys.stderr, flush=True)
        sys.exit(code)


if __name__ == "__main__":
    main()
