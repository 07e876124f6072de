"""Run a test function in several processes with a real process group (gloo on CPU, nccl on GPU).

OLMo-core style: start N fresh processes, each initialises the default group and runs `fn(rank, world_size, *args)`;
what rank r returns comes back as `results[r]`. The rendezvous goes through a file in a fresh temporary directory,
so no TCP port is chosen and nothing depends on port retries. Each rank's stdout/stderr lines are prefixed with
`[rank r]`; an exception on any rank fails the test with that rank's traceback.

Design and reasoning: docs/testing.md#the-distributed-test-harness
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import traceback
from multiprocessing import reduction
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import fork_server


class _Prefixed:
    def __init__(self, stream, prefix: str):
        self.stream, self.prefix, self.at_start = stream, prefix, True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            if self.at_start:
                out.append(self.prefix)
            out.append(piece)
            self.at_start = piece.endswith("\n")
        self.stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


class _Stdio:
    """The test process's stdout and stderr file descriptors, handed to a rank as a spawned rank inherits them
    (pytest captures the current test's output there); pickled as descriptors passed to the new process."""

    def __init__(self, fds=(1, 2)):
        self.fds = fds

    def __reduce__(self):
        return _Stdio._rebuild, tuple(reduction.DupFd(fd) for fd in self.fds)

    @staticmethod
    def _rebuild(*dup_fds) -> "_Stdio":
        return _Stdio(tuple(d.detach() for d in dup_fds))

    def install(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, target in zip(self.fds, (1, 2)):
            os.dup2(fd, target)
            os.close(fd)


def _worker(rank: int, world_size: int, backend: str, store_file: str, out_dir: str, call: bytes, threads: int,
            environ: dict, stdio: _Stdio):
    stdio.install()
    fn, args = pickle.loads(call)
    fork_server.become_fresh(environ)
    sys.stdout = _Prefixed(sys.stdout, f"[rank {rank}] ")
    sys.stderr = _Prefixed(sys.stderr, f"[rank {rank}] ")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    if "nccl" in backend:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        # Every rank's collectives finish before any rank tears its group down: a rank that closes its gloo
        # connections while a peer is still reading the last message aborts that peer ("terminate called without
        # an active exception"). The barrier completes the collectives; a rank leaves it possibly before its peers'
        # last reads end, so each then says so through a store apart from gloo, and all wait for every rank's word.
        dist.barrier()
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        done = dist.FileStore(os.path.join(out_dir, "done"), world_size)
        done.set(f"rank{rank}", "1")
        done.wait([f"rank{r}" for r in range(world_size)])
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, backend: str = "gloo", meanwhile=None):
    """Run fn(rank, world_size, *args) on `world_size` processes; return the per-rank results in rank order.

    `fn` must be importable (a module-level function) because the processes are started fresh, not forked from
    this one.
    meanwhile: a callable this process runs while the ranks run (a single-process reference, say, so that it takes
    a core the ranks leave idle instead of running before or after them); then the return value is
    (per-rank results, meanwhile()). If it raises, the ranks are stopped and its exception propagates."""
    threads = max(1, (os.cpu_count() or 1) // world_size)
    fork_server.context()  # sets the suite's fork server's preload, which start_method="forkserver" uses
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        # fn and its arguments as plain pickle bytes: tensors by value, not as shared-memory file descriptors, of
        # which a fork server takes fewer than 256 per process
        call = pickle.dumps((fn, args))
        context = mp.start_processes(
            _worker, args=(world_size, backend, store, tmp, call, threads, dict(os.environ), _Stdio()),
            nprocs=world_size, join=meanwhile is None, start_method="forkserver")
        local = None
        if meanwhile is not None:
            try:
                local = meanwhile()
            except BaseException:
                for process in context.processes:
                    process.terminate()
                for process in context.processes:
                    process.join()
                raise
            while not context.join():
                pass
        results = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
        return results if meanwhile is None else (results, local)
