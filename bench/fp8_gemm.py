"""FP8 training GEMMs (kernels/fp8_gemm.py) against torch's bf16 matmul at the flagship's expert and attention shapes.

    python bench/fp8_gemm.py [--tokens 4096] [--only wq_b,routed] [--json OUT.jsonl]     (one H100: < 2 minutes)
    python bench/fp8_gemm.py --smoke                                                      (CPU interpreter, tiny shapes)

Shapes (issue 41's flagship widths, 1 x 4,096 tokens): wq_a 5120 -> 1280, wq_b 1280 -> 64 x 512, wkv 5120 -> 512, wo_a
8 groups of 4096 -> 1024 (block-diagonal), wo_b 8192 -> 5120, the shared expert's w1 5120 -> 2304 and w2 2304 -> 5120,
the routed experts' w1 and w2 over 4 x 4,096 token copies sorted among 6 experts (grouped). Per case: TFLOP/s of the
GEMM kernel alone (operands quantised beforehand), of the forward as the model runs it (quantising x and W included)
and of forward + backward (dgrad FP8, wgrad bf16), each against torch bf16 (F.linear / einsum / torch._grouped_mm,
with autograd), median of CUDA-event timed repetitions; and the error: relative L2 distance of y and dx from fp32
matmuls of the same bf16 inputs, for FP8 and for bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

from kernels import fp8_gemm as fg  # noqa: E402
from kernels.fp8 import quantize_fp8  # noqa: E402


def cases(tokens: int, scale: int = 1) -> list[dict]:
    """name, kind (dense / blockdiag / grouped), rows M, in K (per group), out N (per group), groups G."""
    def s(v: int) -> int:  # shrunk by `scale`, kept a multiple of 128
        return max(128, v // scale // 128 * 128)

    d, q, h, o, f, ol = s(5120), s(1280), s(32768), s(4096), s(2304), s(1024)
    return [
        dict(name="wq_a", kind="dense", m=tokens, k=d, n=q, g=1),
        dict(name="wq_b", kind="dense", m=tokens, k=q, n=h, g=1),
        dict(name="wkv", kind="dense", m=tokens, k=d, n=s(512), g=1),
        dict(name="wo_a", kind="blockdiag", m=tokens, k=o, n=ol, g=8),
        dict(name="wo_b", kind="dense", m=tokens, k=8 * ol, n=d, g=1),
        dict(name="shared_w1", kind="dense", m=tokens, k=d, n=f, g=1),
        dict(name="shared_w2", kind="dense", m=tokens, k=f, n=d, g=1),
        dict(name="routed_w1", kind="grouped", m=4 * tokens, k=d, n=f, g=6),
        dict(name="routed_w2", kind="grouped", m=4 * tokens, k=f, n=d, g=6),
    ]


def timer(fn, reps: int) -> float:
    """Median ms of one call (CUDA events on a GPU, wall clock otherwise)."""
    fn()
    cuda = torch.cuda.is_available()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def run_case(c: dict, device: str, reps: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    m, k, n, g, kind = c["m"], c["k"], c["n"], c["g"], c["kind"]
    width = g * k if kind == "blockdiag" else k
    x = torch.randn(m, width, device=device, generator=gen).bfloat16()
    w = (torch.randn(g, n, k, device=device, generator=gen) * k ** -0.5).bfloat16()
    ends = None
    if kind == "grouped":  # uneven groups as a router makes them: +-20% around m / g
        sizes = torch.full((g,), m // g, dtype=torch.int64)
        sizes[: g // 2] += (m // g) // 5
        sizes[g // 2: 2 * (g // 2)] -= (m // g) // 5
        sizes[-1] += m - sizes.sum()
        ends = sizes.cumsum(0).to(torch.int32).to(device)

    def fp8_fwd(xi, wi):
        if kind == "grouped":
            return fg.fp8_grouped_linear(xi, wi, ends)
        if kind == "blockdiag":
            return fg.fp8_blockdiag_linear(xi, wi)
        return fg.fp8_linear(xi, wi[0])

    def bf16_fwd(xi, wi):
        if kind == "grouped":
            return torch._grouped_mm(xi, wi.transpose(-2, -1), offs=ends) if xi.is_cuda else _loop(xi, wi, ends)
        if kind == "blockdiag":
            return torch.einsum("mgk,gnk->mgn", xi.unflatten(-1, (g, -1)), wi).flatten(1)
        return F.linear(xi, wi[0])

    flops = 2 * m * width * n
    # the kernel alone, on operands quantised beforehand
    xq, xs = quantize_fp8(x, 128, impl="triton")
    wq, ws = fg.quantize_weight_fp8(w, impl="triton")
    out = {"case": c["name"], "kind": kind, "M": m, "K": width, "N": n * (g if kind == "blockdiag" else 1), "G": g}
    t_kernel = timer(lambda: fg.fp8_gemm(xq, xs, wq, ws, group_ends=ends, impl="triton"), reps)
    t_fwd8 = timer(lambda: fp8_fwd(x, w), reps)
    t_fwd16 = timer(lambda: bf16_fwd(x, w), reps)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    dy = torch.randn_like(bf16_fwd(x, w))

    def step(fn):
        xg.grad = wg.grad = None
        fn(xg, wg).backward(dy)

    t_fb8 = timer(lambda: step(fp8_fwd), reps)
    t_fb16 = timer(lambda: step(bf16_fwd), reps)
    tf = lambda ms, mult=1: mult * flops / (ms * 1e-3) / 1e12  # noqa: E731
    out.update(kernel_tflops=tf(t_kernel), fwd_fp8_tflops=tf(t_fwd8), fwd_bf16_tflops=tf(t_fwd16),
               fwd_bwd_fp8_tflops=tf(t_fb8, 3), fwd_bwd_bf16_tflops=tf(t_fb16, 3),
               fwd_speedup=t_fwd16 / t_fwd8, fwd_bwd_speedup=t_fb16 / t_fb8)
    # error against fp32 matmuls of the same bf16 inputs
    x32, w32, dy32 = x.float(), w.float(), dy.float()
    y_ref = bf16_fwd(x32, w32) if kind != "grouped" else _loop(x32, w32, ends)
    dx_ref = (_loop(dy32, w32.transpose(1, 2).contiguous(), ends) if kind == "grouped" else
              torch.einsum("mgn,gnk->mgk", dy32.unflatten(-1, (g, -1)), w32).flatten(1))
    rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()  # noqa: E731
    for name, fn in (("fp8", fp8_fwd), ("bf16", bf16_fwd)):
        xg.grad = None
        y = fn(xg, w)
        y.backward(dy)
        out[f"err_y_{name}"], out[f"err_dx_{name}"] = rel(y, y_ref), rel(xg.grad, dx_ref)
    return out


def _loop(x, w, ends):
    outs, start = [], 0
    for e, end in enumerate(ends.tolist()):
        outs.append(x[start:end] @ w[e].T)
        start = end
    return torch.cat(outs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--only", default="", help="comma-separated substrings of case names")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default=None, help="append each case's row to this file")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (widths / 8, 96 tokens) to test this script")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        raise SystemExit("bench/fp8_gemm.py: needs a CUDA GPU (or --smoke, which runs the CPU interpreter)")
    todo = cases(96 if args.smoke else args.tokens, 8 if args.smoke else 1)
    if args.only:
        todo = [c for c in todo if any(s in c["name"] for s in args.only.split(","))]
    reps = 2 if args.smoke else args.reps
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU interpreter"
    print(f"FP8 GEMMs vs bf16 on {name}, torch {torch.__version__}; TFLOP/s (fwd+bwd counts 3 GEMMs)")
    head = (f"{'case':10} {'M x K -> N (G)':>26} {'kernel':>7} {'fwd8':>7} {'fwd16':>7} {'x':>5} {'fb8':>7} {'fb16':>7} "
            f"{'x':>5} {'err y 8/16':>17} {'err dx 8/16':>17}")
    print(head)
    t0 = time.perf_counter()
    for c in todo:
        r = run_case(c, device, reps)
        shape = f"{r['M']} x {r['K']} -> {r['N']} ({r['G']})"
        print(f"{r['case']:10} {shape:>26} {r['kernel_tflops']:7.1f} {r['fwd_fp8_tflops']:7.1f} "
              f"{r['fwd_bf16_tflops']:7.1f} {r['fwd_speedup']:5.2f} {r['fwd_bwd_fp8_tflops']:7.1f} "
              f"{r['fwd_bwd_bf16_tflops']:7.1f} {r['fwd_bwd_speedup']:5.2f} "
              f"{r['err_y_fp8']:8.2e}/{r['err_y_bf16']:8.2e} {r['err_dx_fp8']:8.2e}/{r['err_dx_bf16']:8.2e}",
              flush=True)
        if args.json:
            with open(args.json, "a") as fh:
                fh.write(json.dumps(dict(r, device=name)) + "\n")
    print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
