"""Cedar's FP8 training linear (model/fp8.py) against the library that offers the same: torchao's float8 training
(issue 41: "torchao's float8 training or your own Triton, whichever measures better"), on the flagship's dense
projections, forward + backward, each against bf16 in the same run.

    python3 bench/fp8_libraries.py [--tokens 4096] [--reps 20] [--json OUT.jsonl]      (one H100 or H200: ~2 minutes)

Variants per shape (bias-free linears, bf16 weights and inputs; forward + backward of x and W, the median of CUDA-event
timed repetitions):
- bf16: nn.Linear, eager and torch.compile'd;
- cedar: model.fp8.Fp8Linear (DeepSeek-V3's recipe: x 1 x 128, W 128 x 128 power-of-two (e8m0) scales, FP8 forward and
  dgrad, bf16 wgrad; kernels/fp8_gemm_triton.py);
- torchao blockwise: torchao.prototype.blockwise_fp8_training's Float8BlockwiseLinear, the same recipe, with its Triton
  GEMMs (use_triton=True) and with torch._scaled_mm (use_triton=False);
- torchao rowwise / tensorwise: torchao.float8.convert_to_float8_training with those recipes, torch.compile'd (its
  casts are meant to be fused by Inductor).
Per variant: ms, TFLOP/s (3 GEMMs' FLOPs), speed-up over eager bf16, and the error of y and dx against fp32 matmuls of
the same bf16 inputs (relative L2). A variant that fails (a missing library, an unsupported shape) is one line and the
others run. torchao is not a dependency of the project: carry its wheel to the device (`pip download torchao
--no-deps`; 0.17.0 was the version tried for torch 2.11).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fp8_gemm import cases, timer  # noqa: E402
from model.fp8 import Fp8Linear  # noqa: E402


def variants(base: nn.Linear) -> dict:
    """name -> a callable that builds the module (a failure is reported by name)."""
    def cedar():
        m = Fp8Linear(base.in_features, base.out_features)
        m.weight = base.weight
        return m

    def ao_blockwise(use_triton: bool):
        def make():
            from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear
            m = Float8BlockwiseLinear.from_float(copy.deepcopy(base))
            m.use_triton = use_triton
            return m
        return make

    def ao_recipe(name: str):
        def make():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            m = convert_to_float8_training(nn.Sequential(copy.deepcopy(base)),
                                           config=Float8LinearConfig.from_recipe_name(name))
            return torch.compile(m)
        return make

    return {"bf16": lambda: base, "bf16 compiled": lambda: torch.compile(copy.deepcopy(base)), "cedar fp8": cedar,
            "torchao blockwise triton": ao_blockwise(True), "torchao blockwise scaled_mm": ao_blockwise(False),
            "torchao rowwise compiled": ao_recipe("rowwise"), "torchao tensorwise compiled": ao_recipe("tensorwise")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: bench/fp8_libraries.py times FP8 GEMMs: it needs a CUDA device (H100 or H200)")
    dev = torch.device("cuda")
    print(f"FP8 training linears, {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, {args.tokens} tokens")
    for c in (c for c in cases(args.tokens) if c["kind"] == "dense"):
        m_, k, n = c["m"], c["k"], c["n"]
        g = torch.Generator(device=dev).manual_seed(0)
        base = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            base.weight.copy_(torch.randn(n, k, device=dev, generator=g) * k ** -0.5)
        x = torch.randn(m_, k, device=dev, generator=g).bfloat16().requires_grad_()
        dy = torch.randn(m_, n, device=dev, generator=g).bfloat16()
        x32, w32, dy32 = x.detach().float(), base.weight.detach().float(), dy.float()
        y_ref, dx_ref = x32 @ w32.T, dy32 @ w32
        rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()  # noqa: E731
        flops = 3 * 2 * m_ * k * n
        print(f" {c['name']}: {m_} x {k} -> {n}")
        base_ms = None
        for name, make in variants(base).items():
            try:
                mod = make()

                def step():
                    x.grad = None
                    for prm in mod.parameters():
                        prm.grad = None
                    mod(x).backward(dy)

                ms = timer(step, args.reps)
                x.grad = None
                y = mod(x)
                y.backward(dy)
                err_y, err_dx = rel(y.detach(), y_ref), rel(x.grad, dx_ref)
            except Exception as e:  # noqa: BLE001 (a variant that cannot run is a line of the result)
                print(f"  {name:28s} FAILED {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200])
                continue
            base_ms = base_ms or ms
            row = dict(bench="fp8_libraries", case=c["name"], M=m_, K=k, N=n, variant=name, ms=ms,
                       tflops=flops / (ms * 1e-3) / 1e12, speedup=base_ms / ms, err_y=err_y, err_dx=err_dx,
                       device=torch.cuda.get_device_name(dev))
            print(f"  {name:28s} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s {row['speedup']:5.2f}x bf16   "
                  f"err y {err_y:.2e} dx {err_dx:.2e}")
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
