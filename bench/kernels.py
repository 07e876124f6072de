"""Kernel benchmark: every case of bench/kernel_cases/*.py against the ceilings measured in the same run.

Usage (one H200): python bench/kernels.py [--only NAME_SUBSTRING] [--json OUT.json]

Ceilings, measured first: device-to-device copy bandwidth (a 4 GiB clone: bytes read + bytes written) and the dense
bf16 matmul rate (8192^3). Short kernels are timed as back-to-back queued calls. Each case provides `fn_triton`, `fn_baseline` (the PyTorch path on the same inputs) and
either `bytes` (ideal traffic of the kernel) or `flops` (useful FLOPs). The table gives median times over CUDA-event
timed repetitions, the achieved TB/s or TFLOP/s, the percentage of the matching ceiling, and the speed-up over the
baseline.
"""

from __future__ import annotations

import argparse
import importlib
import json
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


def load_cases(only: str | None) -> list[dict]:
    import bench.kernel_cases as pkg

    cases = []
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"bench.kernel_cases.{info.name}")
        if hasattr(mod, "cases"):
            for case in mod.cases():
                if only is None or only in case["name"]:
                    cases.append(case)
    return cases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA device")
    ceil = ceilings()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy {ceil['copy_TBps']:.2f} TB/s  "
          f"bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    print(f"{'case':48s} {'triton ms':>10s} {'base ms':>10s} {'achieved':>14s} {'% ceil':>7s} {'speed-up':>8s}")
    rows = []
    for case in load_cases(args.only):
        try:
            t = time_ms(case["fn_triton"])
            b = time_ms(case["fn_baseline"])
        except Exception as e:  # a failing case is reported, the others still run
            print(f"{case['name']:48s} FAILED: {type(e).__name__}: {str(e)[:120]}")
            rows.append({"name": case["name"], "error": str(e)})
            continue
        if "flops" in case:
            rate = case["flops"] / (t * 1e-3) / 1e12
            unit, pct = "TFLOP/s", 100 * rate / ceil["bf16_matmul_TFLOPs"]
        else:
            rate = case["bytes"] / (t * 1e-3) / 1e12
            unit, pct = "TB/s", 100 * rate / ceil["copy_TBps"]
        print(f"{case['name']:48s} {t:10.3f} {b:10.3f} {rate:8.2f} {unit:7s} {pct:6.1f}% {b / t:7.1f}x")
        rows.append({"name": case["name"], "triton_ms": t, "baseline_ms": b, "rate": rate, "unit": unit,
                     "pct_of_ceiling": pct, "speedup": b / t})
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"ceilings": ceil, "cases": rows}, indent=2))


if __name__ == "__main__":
    main()
