"""Tile sweep of the mHC step's backward kernel (`kernels.mhc_triton.mhc_step_bwd`) at a model's own shape.

bench/kernel_cases/mhc.py times the flagship's shape (16,384 tokens, D = 5,120, bf16 streams). A training step of
v41_small runs the kernel on 8,192 tokens of D = 1,024 with fp32 streams (the trainer's fp32 weights under a bf16
autocast: the block input y is bf16, the streams S fp32), 24 times a step. Each configuration is checked against the
shipped one (largest relative difference of every output) and timed; the traffic is y, S, dL/dS', dL/dx read and
dL/dy, dL/dS written, against a device-to-device copy of the same bytes.

Usage (GPU): python bench/mhc_shapes.py [--tokens 8192 --dim 1024 --streams 4 --s-dtype fp32] [--json OUT.jsonl]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernels import copy_ms, time_ms  # noqa: E402
from kernels import mhc_triton  # noqa: E402

# Session 20's H100 run swept block_t (8, 16, 32) x block_d (64, 128, 256) x warps (4, 8) x stages (2, 3) with one
# program per token block: 0.73-5.7 ms, none above 22% of copy (BENCHMARKS.md). The grid now adds the channel split
# (more programs in flight: v41_small's 8,192 tokens make 512 programs of 16) around the best tiles.
GRID = [dict(block_t=t, block_d=d, num_warps=w, num_stages=s, split_d=k)
        for t, d, w, s, k in itertools.product((8, 16, 32), (64, 128), (4,), (2, 3), (1, 2, 4, 8))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--s-dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    N, n, D = args.tokens, args.streams, args.dim
    s_dtype = torch.float32 if args.s_dtype == "fp32" else torch.bfloat16
    M = 2 * n + n * n
    g = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randn(N, D, device="cuda", generator=g).to(torch.bfloat16)
    S = torch.randn(N, n, D, device="cuda", generator=g).to(s_dtype)
    mix = torch.randn(N, n + 1, n + 1, device="cuda", generator=g) * 0.5
    fn = torch.randn(M, n * D, device="cuda", generator=g) * 0.02
    s_new = mhc_triton.mhc_step_fwd(y, S, mix, fn)[0]
    g_s, g_x = torch.randn_like(S), torch.randn(N, D, device="cuda", generator=g).to(s_dtype)
    g_sumsq, g_raw = torch.randn(N, device="cuda", generator=g), torch.randn(N, M, device="cuda", generator=g)
    args_ = (y, S, mix, fn, s_new, g_s, g_x, g_sumsq, g_raw)
    ref = mhc_triton.mhc_step_bwd(*args_)
    es, ey = S.element_size(), y.element_size()
    traffic = N * D * (ey + 3 * n * es + es + ey)  # y, S, dS', dx read; dy, dS written (mix, stats: small)
    copy = copy_ms(traffic)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; N={N} n={n} D={D} S {args.s_dtype}; "
          f"{traffic / 1e6:.0f} MB moved, a copy of as many bytes {copy:.4f} ms", flush=True)
    out = open(args.json, "a") if args.json else None
    rows = []
    for cfg in [{}] + GRID:
        try:
            got = mhc_triton.mhc_step_bwd(*args_, **cfg)
            err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                      for a, b in zip(got, ref) if b is not None)
            ms = time_ms(lambda: mhc_triton.mhc_step_bwd(*args_, **cfg), reps=args.reps)
            row = {"config": cfg or "default", "ms": round(ms, 4), "pct_copy": round(100 * copy / ms, 1),
                   "max_rel_err": err}
        except Exception as exc:  # a tile that does not fit
            row = {"config": cfg, "error": f"{type(exc).__name__}: {exc}"[:200]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps({"N": N, "n": n, "D": D, "s_dtype": args.s_dtype, **row}) + "\n")
            out.flush()
    ok = [r for r in rows if "ms" in r]
    best, base = min(ok, key=lambda r: r["ms"]), ok[0]
    print(f"default {base['ms']:.4f} ms ({base['pct_copy']}% of copy); best {best['config']} {best['ms']:.4f} ms "
          f"({best['pct_copy']}%), {base['ms'] / best['ms']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
