"""Launch-configuration sweep of the sparse attention kernels at a model's own shape.

bench/kernel_cases/sparse_attention.py times the flagship's decoder shape (H=64, D=512, top-512 of 32K), for which
`kernels.sparse_attention.FWD_CONFIG` / `BWD_CONFIG` were tuned. A small config has other tiles: v41_small has 16
heads of width 256 and selects 256 of 1,024 (encoder, ratio 2) or 2,048 (decoder, ratio 1) entries at 2K context,
so a tile of [16 heads, 256 channels] per query serves far fewer FLOPs per key byte loaded (its launches read
`FWD_CONFIG_FEW_HEADS` / `BWD_CONFIG_FEW_HEADS`, chosen from this script's first run). This script times every
configuration in a small grid at such a shape, forward and backward, and reports each one's largest difference from
the shipped configuration's outputs (bf16 rounding of other summation orders; the backward's atomics make its last
bits vary run to run).

Usage (GPU): python bench/sparse_attention_shapes.py --model v41_small [--json OUT.jsonl]
or an explicit --shape B,T,H,D,W,K,RATIO.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels.sparse_attention as sa  # noqa: E402
from bench.kernel_cases.sparse_attention import _with_config, random_topk  # noqa: E402
from bench.kernels import time_ms  # noqa: E402

# batch, tokens, heads, width, window, top-k, compression ratio of the entries the top-k selects from
SHAPES = {
    "v41_small_enc": (4, 2048, 16, 256, 128, 256, 2),
    "v41_small_dec": (4, 2048, 16, 256, 128, 256, 1),
    "flagship_dec": (1, 32768, 64, 512, 128, 512, 1),
}
MODELS = {"v41_small": ["v41_small_enc", "v41_small_dec"], "flagship": ["flagship_dec"]}

FWD_GRID = [{"BLOCK_N": n, "fwd": (w, s)} for n, w, s in itertools.product((32, 64, 128), (4, 8), (1, 2, 3))]
BWD_GRID = [{"BLOCK_N": n, "probs_block_n": n, "probs": (w, 1), "dq": (w, s), "dkv": (w, s)}
            for n, w, s in itertools.product((32, 64, 128), (4, 8), (1, 2))]


def inputs(shape, device="cuda"):
    B, T, H, D, W, K, ratio = shape
    g = torch.Generator(device=device).manual_seed(0)
    E = T // ratio
    q = torch.randn(B, T, H, D, device=device, dtype=torch.bfloat16, generator=g)
    kv_win = torch.randn(B, T, D, device=device, dtype=torch.bfloat16, generator=g)
    kv_cmp = torch.randn(B, E, D, device=device, dtype=torch.bfloat16, generator=g)
    sink = torch.randn(H, device=device, dtype=torch.float32, generator=g)
    idx = random_topk(B, T, E, K, ratio, device)
    return q, kv_win, kv_cmp, idx, sink, W


def useful_flops(shape, idx) -> int:
    """QK^T and PV over every key a query sees: window keys (fewer at the start) and valid top-k slots."""
    B, T, H, D, W, K, ratio = shape
    t = torch.arange(T, device=idx.device)
    win = torch.clamp(t + 1, max=W).sum().item() * B
    top = (idx >= 0).sum().item()
    return 4 * H * D * (win + top)


def run(shape, args, out):
    q, kv_win, kv_cmp, idx, sink, W = inputs(shape)
    flops = useful_flops(shape, idx)
    leaves = [t.detach().requires_grad_() for t in (q, kv_win, kv_cmp, sink)]
    grad = torch.randn_like(q)

    def attend(q, kv_win, kv_cmp, sink):
        return sa.sparse_attention(q, kv_win, kv_cmp, idx, sink, W, impl="triton")

    def measure(what: str) -> tuple[float, float, int]:
        """(largest difference from the shipped config's outputs, ms, useful FLOPs) under the config now set."""
        if what == "fwd":
            fwd = lambda: attend(q, kv_win, kv_cmp, sink)  # noqa: E731
            return (fwd().float() - ref_out).abs().max().item(), time_ms(fwd, reps=args.reps), flops
        o = attend(*leaves)
        bwd = lambda: torch.autograd.grad(o, leaves, grad, retain_graph=True)  # noqa: E731
        err = max(((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
                  for a, b in zip(bwd(), ref_grads))
        return err, time_ms(bwd, reps=args.reps), int(2.5 * flops)

    ref_out = attend(q, kv_win, kv_cmp, sink).float()
    ref_grads = [g.float() for g in torch.autograd.grad(attend(*leaves), leaves, grad)]
    name = ",".join(map(str, shape))
    rows = []
    block_h = sa._tiles(shape[2], shape[3])[0]
    for what, grid in (("fwd", FWD_GRID), ("bwd", BWD_GRID)):
        config = sa.launch_config(what, block_h)  # the dict this shape's launches read
        for overrides in [{}] + grid:
            try:
                err, ms, f = _with_config(config, overrides, lambda: measure(what))()
                row = {"shape": name, "what": what, "config": overrides or "default", "ms": round(ms, 4),
                       "TFLOPs": round(f / ms / 1e9, 1), "max_err": err}
            except Exception as exc:  # a launch that does not fit (shared memory, registers)
                row = {"shape": name, "what": what, "config": overrides, "error": f"{type(exc).__name__}: {exc}"[:200]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
    for what in ("fwd", "bwd"):
        ok = [r for r in rows if r["what"] == what and "ms" in r]
        best = min(ok, key=lambda r: r["ms"])
        base = next(r for r in ok if r["config"] == "default")
        print(f"{name} {what}: default {base['ms']:.3f} ms ({base['TFLOPs']} TFLOP/s); best {best['config']} "
              f"{best['ms']:.3f} ms ({best['TFLOPs']} TFLOP/s), {base['ms'] / best['ms']:.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="v41_small", choices=sorted(MODELS))
    ap.add_argument("--shape", default=None, help="B,T,H,D,W,K,RATIO instead of --model's shapes")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in args.shape.split(","))] if args.shape else [SHAPES[s] for s in MODELS[args.model]]
    out = open(args.json, "a") if args.json else None
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for shape in shapes:
        run(shape, args, out)


if __name__ == "__main__":
    main()
