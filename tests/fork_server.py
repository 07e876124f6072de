"""The suite's fork server: the clean process that the distributed harness's ranks (tests/distributed.py) and the
command-line runs of `run_module` are forked from, so that none of them pays the imports of a fresh interpreter.

Contract: `run_module(module, args)` is `subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
text=True)` with the given working directory, environment and timeout, and returns the same CompletedProcess (exit
status, or -signal when killed; stdout and stderr as text; TimeoutExpired after killing it). The program runs as
`python -m` runs it (`__main__`, sys.argv[0] its file, the environment replaced by `env`) in a process forked from
the fork server, and ends as an interpreter ends: non-daemon threads joined, atexit functions run, stdio flushed.
What differs from a fresh interpreter: the modules of PRELOAD are already imported (with the environment the fork
server started with: IMPORT_TIME_ENV, read when they are imported, is checked equal), and hash randomisation is the
fork server's. Programs whose behaviour depends on how the interpreter starts (import errors, a console script,
another interpreter's flags) keep a real subprocess.

Design and reasoning: docs/testing.md#the-fork-server
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.connection
import os
import random
import runpy
import subprocess
import sys
import tempfile
import threading
import time
import traceback

# What every rank and command-line run imports anyway; the fork server imports it once. Only library modules here:
# never a test module (a rank imports its own when its function is unpickled) nor a program run as __main__
# (trainer.cli.main: a program that runs it with runpy, as tests/trainer/faults.py does, would find it imported).
PRELOAD = [
    "numpy", "pytest", "torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
    "torch.distributed.checkpoint", "torch.distributed.pipelining", "model", "data", "optim", "trainer.train",
    "trainer.checkpoint", "trainer.parallel.pipeline", "trainer.parallel.context", "trainer.parallel.expert", "hydra",
    "omegaconf", "trainer.compose", "trainer.cli.app",
]
# Read when the kernels are imported (tests/conftest.py sets it before anything imports them): the fork server's
# value must be the test process's.
IMPORT_TIME_ENV = ("TRITON_INTERPRET",)


def context():
    """multiprocessing's forkserver context, with PRELOAD for when the fork server starts (the session's first use)."""
    mp.set_forkserver_preload(PRELOAD)
    return mp.get_context("forkserver")


def become_fresh(environ: dict) -> None:
    """In a process just forked from the fork server: take `environ` (the launching process's; IMPORT_TIME_ENV checked
    equal to the fork server's) and seed the random generators from the OS, as a new process's are (forked ones would
    all start from the fork server's states)."""
    import numpy as np
    import torch

    for key in IMPORT_TIME_ENV:
        assert os.environ.get(key) == environ.get(key), \
            f"{key}={environ.get(key)!r} here but {os.environ.get(key)!r} when the fork server imported the kernels"
    os.environ.clear()
    os.environ.update(environ)
    torch.seed()
    np.random.seed()
    random.seed()


def _exit_code(e: SystemExit) -> int:
    """The status the interpreter exits with for `e` (sys.exit(None) 0, an int itself, anything else printed, 1)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _run_child(module: str, args: list[str], cwd: str, environ: dict, out_path: str, err_path: str) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for path, fd in ((out_path, 1), (err_path, 2)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    become_fresh(environ)
    os.chdir(cwd)
    sys.argv = [module, *args]  # run_module puts the module's file first, as `python -m` does
    sys.modules.pop(module, None)  # should a preloaded module import it: `python -m` runs it only as __main__
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:
        traceback.print_exc()
        code = 1
    # an interpreter's end: wait for non-daemon threads, then the atexit functions, then flush stdio
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def run_module(module: str, args: list[str], *, cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` forked from the fork server: the module docstring's contract."""
    return run_modules([(module, args, env)], cwd=cwd, timeout=timeout)[0]


def run_modules(runs: list[tuple[str, list[str], dict]], *, cwd, timeout: float) -> list[subprocess.CompletedProcess]:
    """Several `python -m MODULE ARGS` at once (module, args, environment each), each as `run_module` runs one; when
    one fails the others are killed (as torchrun stops a job whose rank failed: its peers would wait in a collective),
    and their CompletedProcesses say -SIGKILL. TimeoutExpired (of the first) after killing them all."""
    with tempfile.TemporaryDirectory() as tmp:
        procs, files = [], []
        for i, (module, args, environ) in enumerate(runs):
            out, err = os.path.join(tmp, f"stdout{i}"), os.path.join(tmp, f"stderr{i}")
            proc = context().Process(target=_run_child, args=(module, list(args), str(cwd), dict(environ), out, err))
            proc.start()
            procs.append(proc)
            files.append((out, err))
        deadline = time.monotonic() + timeout
        running = list(procs)
        while running and time.monotonic() < deadline:  # until all have ended, one failed, or the time is up
            mp.connection.wait([p.sentinel for p in running], max(0.0, deadline - time.monotonic()))
            running = [p for p in running if p.exitcode is None]
            if any(p.exitcode not in (None, 0) for p in procs):
                break
        timed_out = any(p.exitcode is None for p in procs) and not any(p.exitcode not in (None, 0) for p in procs)
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
        results = []
        for (module, args, _), p, (out, err) in zip(runs, procs, files):
            with open(out, errors="replace") as f_out, open(err, errors="replace") as f_err:
                results.append(subprocess.CompletedProcess([sys.executable, "-m", module, *args], p.exitcode,
                                                           f_out.read(), f_err.read()))
    if timed_out:
        first = results[0]
        raise subprocess.TimeoutExpired(first.args, timeout, output=first.stdout, stderr=first.stderr)
    return results
