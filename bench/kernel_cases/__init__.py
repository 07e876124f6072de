"""Benchmark cases for the Triton kernels, one module per kernel family (fp4, mhc, engram, ...).

Each module exposes `cases(sweep: bool = False) -> list[dict]`; a case is a dict with
    name         unique, "<family>/<what>[/<config>]"
    fn_triton    callable, no arguments: the Triton path
    fn_baseline  callable, no arguments: the PyTorch reference on the same inputs; or None for a variant of
                 another case (its speed-up is read against that case's row)
    bytes        bytes the ideal kernel moves (each input read once, each output written once), or
    flops        for compute-bound cases
    sweep        optional, True on the extra tile-configuration cases (their baseline is a no-op)
Inputs are built (on CUDA) when `cases()` is called. `sweep=True` adds the same case at other tile
configurations (names end in the configuration) to pick defaults; the runner `bench/kernels.py` times the
default set with CUDA events and reports TB/s against the measured copy bandwidth.

`time_cases` is a small standalone timer for a quick look and for tile sweeps (triton.testing.do_bench, which
clears the L2 between repetitions), e.g. `python -c "from bench.kernel_cases import time_cases;
time_cases(('mhc',), sweep=True)"`; the runner is the reference for reported figures.
"""

from __future__ import annotations

import importlib

FAMILIES = ("fp4", "mhc", "engram", "norm_rope_fp4", "topk")


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in TB/s, counting bytes read plus bytes written."""
    import torch
    from triton.testing import do_bench

    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=5, rep=50)
    return 2 * num_bytes / ms / 1e9


def time_cases(families: tuple[str, ...] = FAMILIES, sweep: bool = False, baseline: bool = True) -> list[dict]:
    """Time every case of `families`; print one line each and return the rows."""
    import torch
    from triton.testing import do_bench

    peak = copy_bandwidth()
    print(f"copy bandwidth: {peak:.2f} TB/s")
    rows = []
    for family in families:
        for case in importlib.import_module(f"bench.kernel_cases.{family}").cases(sweep=sweep):
            row = {"name": case["name"]}
            with_baseline = baseline and not case.get("sweep") and case["fn_baseline"] is not None
            fns = [("triton", case["fn_triton"])] + ([("baseline", case["fn_baseline"])] if with_baseline else [])
            for label, fn in fns:
                try:
                    row[label + "_ms"] = do_bench(fn, warmup=5, rep=40)
                except Exception as e:  # a config that fails to compile must not stop the sweep
                    row[label + "_ms"] = float("nan")
                    row[label + "_error"] = repr(e)[:300]
            if "bytes" in case:
                row["triton_tbs"] = case["bytes"] / row["triton_ms"] / 1e9
                row["frac_copy"] = row["triton_tbs"] / peak
            print(row, flush=True)
            rows.append(row)
            del case
            torch.cuda.empty_cache()
    return rows
