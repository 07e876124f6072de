"""Kernel benchmark: every case of bench/kernel_cases/*.py against the ceilings measured in the same run.

Usage (one H200): python bench/kernels.py [--only SUBSTRING[,SUBSTRING...]] [--sweep] [--json OUT.jsonl]

Ceilings, measured first: device-to-device copy bandwidth (a 4 GiB clone: bytes read + bytes written) and the dense
bf16 matmul rate (8192^3). Short kernels are timed as back-to-back queued calls. Each case provides `fn_triton`,
`fn_baseline` (the PyTorch path on the same inputs, or None; a baseline that fails, e.g. out of memory, is noted
on the kernel's row) and either `bytes` (ideal traffic of the kernel) or `flops` (useful FLOPs). The table gives
median times over CUDA-event
timed repetitions, the achieved TB/s or TFLOP/s, the percentage of the matching ceiling, and the speed-up over the
baseline, and the share of a device-to-device copy moving the case's bytes at the same size (`% copy@size`: what
a memory-bound kernel of that size could reach). `--sweep` times the tile-configuration cases instead, Triton only.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import pkgutil
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def time_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median GPU time of one call. Calls are queued back to back between two events (enough of them to fill about
    a millisecond), so a short kernel is timed without the host's launch latency in every sample."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    inner = max(1, min(100, int(1.0 / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def ceilings() -> dict:
    x = torch.empty(1 << 31, dtype=torch.bfloat16, device="cuda")  # 4 GiB
    ms = time_ms(lambda: x.clone(), reps=10)
    copy_tbs = 2 * x.numel() * 2 / (ms * 1e-3) / 1e12
    del x
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, reps=20)
    mm_tflops = 2 * n ** 3 / (ms * 1e-3) / 1e12
    return {"copy_TBps": copy_tbs, "bf16_matmul_TFLOPs": mm_tflops}


def load_cases(only: str | None, sweep: bool = False):
    """Yields the cases one kernel family at a time (a family's inputs are freed before the next is built); with
    `sweep`, only the extra tile-configuration cases, else only the default ones."""
    import bench.kernel_cases as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"bench.kernel_cases.{info.name}")
        if not hasattr(mod, "cases"):
            continue
        for case in mod.cases(sweep=sweep):
            if bool(case.get("sweep")) == sweep and (only is None or any(o in case["name"] for o in only.split(","))):
                yield case
        torch.cuda.empty_cache()


_COPY_MS: dict[int, float] = {}


def copy_ms(num_bytes: int) -> float:
    """Time of a device-to-device copy moving `num_bytes` in all (half read, half written): the bandwidth a kernel of
    that traffic could reach at that size (a small one sits partly in the 50 MB L2 and pays the launch)."""
    n = max(num_bytes // 2, 1)
    if n not in _COPY_MS:
        src = torch.empty(n, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        _COPY_MS[n] = time_ms(lambda: dst.copy_(src))
        del src, dst
    return _COPY_MS[n]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None, help="comma-separated substrings of case names")
    ap.add_argument("--sweep", action="store_true", help="time the tile-configuration sweep cases (Triton only)")
    ap.add_argument("--json", default=None, help="append one JSON line per case (written as each is timed)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA device")
    ceil = ceilings()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy {ceil['copy_TBps']:.2f} TB/s  "
          f"bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s", flush=True)
    print(f"{'case':56s} {'triton ms':>10s} {'base ms':>10s} {'achieved':>14s} {'% ceil':>7s} {'% copy@size':>11s} "
          f"{'speed-up':>8s}", flush=True)

    def emit(row: dict) -> None:
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({**row, "ceilings": ceil}) + "\n")

    for case in load_cases(args.only, args.sweep):
        try:
            t = time_ms(case["fn_triton"])
        except Exception as e:  # a failing case is reported, the others still run
            print(f"{case['name']:56s} FAILED: {type(e).__name__}: {str(e)[:160]}", flush=True)
            emit({"name": case["name"], "error": str(e)[:2000]})
            continue
        b, note = math.nan, ""
        if not args.sweep and case["fn_baseline"] is not None:
            try:
                b = time_ms(case["fn_baseline"])
            except Exception as e:  # e.g. out of memory: the kernel's row still counts, its baseline is marked
                note = f"  (baseline: {type(e).__name__}: {str(e)[:120]})"
                torch.cuda.empty_cache()
        size_pct = math.nan
        if "flops" in case:
            rate = case["flops"] / (t * 1e-3) / 1e12
            unit, pct = "TFLOP/s", 100 * rate / ceil["bf16_matmul_TFLOPs"]
        else:
            rate = case["bytes"] / (t * 1e-3) / 1e12
            unit, pct = "TB/s", 100 * rate / ceil["copy_TBps"]
            size_pct = 100 * copy_ms(case["bytes"]) / t
        print(f"{case['name']:56s} {t:10.3f} {b:10.3f} {rate:8.2f} {unit:7s} {pct:6.1f}% {size_pct:10.1f}% "
              f"{b / t:7.1f}x{note}", flush=True)
        emit({"name": case["name"], "triton_ms": t, "baseline_ms": b, "rate": rate, "unit": unit,
              "pct_of_ceiling": pct, "pct_of_copy_at_size": size_pct, "speedup": b / t})
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
