"""The code sandbox's cost (BENCHMARKS.md, issue 43), every figure and its baseline measured in one run:

1. per run: wall time of `run_sandboxed("pass")` with the in-process guard alone (CEDAR_SANDBOX=inprocess, the design
   before issue 43: the baseline) and in bubblewrap (the default), beside a bare `python -I -S -B -c pass` (the
   floor). The isolation's overhead is bwrap's median minus the baseline's;
2. one RL step's scoring: 64 python_fn responses (8 prompts x 8 samples, the RL stage's defaults; half worked
   answers, half wrong) scored one after another as the RL stage's loop calls `score`, in-process (baseline) and
   in bwrap, and with `PythonFn.score_many` (bwrap, the pool on the CPUs this process may use).

The configurations alternate, `--rounds` times, so a load change on a shared machine hits each alike; medians.

    python bench/sandbox.py [--runs 30] [--rounds 3] [--batch 64]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data.envs.python_fn import PythonFn  # noqa: E402 - after the path set-up above
from data.envs.sandbox import MODE_VARIABLE, run_sandboxed, sandbox_backend  # noqa: E402


def _mode(mode: str) -> None:
    os.environ[MODE_VARIABLE] = mode
    sandbox_backend()  # resolved (and probed) outside the timings


def per_run_ms(mode: str, runs: int) -> list[float]:
    _mode(mode)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        result = run_sandboxed("pass")
        times.append((time.perf_counter() - start) * 1e3)
        assert result.ok, result
    return times


def bare_ms(runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-S", "-B", "-c", "pass"], check=True)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def batch(n: int):
    env = PythonFn()
    rng = random.Random(0)
    problems = [env.sample(rng, 1 + i % env.levels) for i in range(n)]
    responses = [p.worked(effort=100) if i % 2 == 0 else "def f(*args):\n    return 0" for i, p in enumerate(problems)]
    return env, problems, responses


def step_s(mode: str, pooled: bool, n: int) -> tuple[float, int]:
    _mode(mode)
    env, problems, responses = batch(n)
    start = time.perf_counter()
    if pooled:
        scores = env.score_many(problems, responses)
    else:
        scores = [env.score(p, r) for p, r in zip(problems, responses)]
    elapsed = time.perf_counter() - start
    return elapsed, sum(s.correct for s in scores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="runs of `pass` per configuration and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64, help="responses scored per RL step")
    args = parser.parse_args()
    cpus = len(os.sched_getaffinity(0))
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {model}, {cpus} CPUs; load average "
          f"{os.getloadavg()[0]:.1f}; Python {platform.python_version()}; "
          f"bwrap {subprocess.run(['bwrap', '--version'], capture_output=True, text=True).stdout.split()[-1]}")
    runs = {"bare": [], "inprocess": [], "bwrap": []}
    steps = {"inprocess, one by one": [], "bwrap, one by one": [], f"bwrap, score_many ({cpus} workers)": []}
    correct = {}
    for _ in range(args.rounds):
        runs["bare"] += bare_ms(args.runs)
        runs["inprocess"] += per_run_ms("inprocess", args.runs)
        runs["bwrap"] += per_run_ms("bwrap", args.runs)
        for (key, mode, pooled) in zip(steps, ("inprocess", "bwrap", "bwrap"), (False, False, True)):
            elapsed, right = step_s(mode, pooled, args.batch)
            steps[key].append(elapsed)
            correct[key] = right
    print(f"\nper run, ms ({args.rounds} x {args.runs} runs): median / mean / p90")
    for key, times in runs.items():
        times = sorted(times)
        print(f"  {key:10s} {statistics.median(times):6.1f} / {statistics.fmean(times):6.1f} / "
              f"{times[int(0.9 * len(times))]:6.1f}")
    overhead = statistics.median(runs["bwrap"]) - statistics.median(runs["inprocess"])
    print(f"  isolation overhead (bwrap - inprocess medians): {overhead:.1f} ms")
    print(f"\none RL step's scoring, {args.batch} python_fn responses, s: median of {args.rounds} (correct)")
    for key, times in steps.items():
        print(f"  {key:34s} {statistics.median(times):6.2f}  ({correct[key]}/{args.batch})")


if __name__ == "__main__":
    main()
