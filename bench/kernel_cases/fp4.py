"""Benchmark cases: FP4 / FP8 block quantisation (kernels/fp4_triton.py) vs the PyTorch references.

Main case (SPEC 1.4 main KV): FP4 quantise of a [32768, 512] bf16 tensor, e4m3 scale per 16 (target >= 2.5 TB/s).
Bytes: 2 B read + 0.5 B codes + 1/16 B scale written per element.
"""

from __future__ import annotations

import torch

from kernels import fp4, fp4_triton

ROWS, DIM = 32768, 512

DEVICE = "cuda"  # the runner times on the GPU; a CPU dry run (TRITON_INTERPRET=1, small sizes) patches it


def _case(name, fn_triton, fn_baseline, num_bytes, sweep=False):
    return {"name": name, "fn_triton": fn_triton, "fn_baseline": fn_baseline, "bytes": num_bytes, "sweep": sweep}


def cases(sweep: bool = False) -> list[dict]:
    x = torch.randn(ROWS, DIM, dtype=torch.bfloat16, device=DEVICE)
    n = x.numel()
    codes, scales = fp4_triton.quantize(x, 16, "e4m3")
    values8, scales8 = fp4_triton.quantize_fp8(x, 32)
    out = [
        _case("fp4/quantize_e4m3_b16", lambda: fp4_triton.quantize(x, 16, "e4m3"),
              lambda: fp4.quantize(x, 16, "e4m3"), 2 * n + n // 2 + n // 16),
        _case("fp4/quantize_ue8m0_b32", lambda: fp4_triton.quantize(x, 32, "ue8m0"),
              lambda: fp4.quantize(x, 32, "ue8m0"), 2 * n + n // 2 + n // 32),
        _case("fp4/fake_quant_e4m3_b16", lambda: fp4_triton.fake_quant(x, 16, "e4m3"),
              lambda: fp4.fake_quant(x, 16, "e4m3"), 4 * n),
        _case("fp4/dequantize_e4m3_b16", lambda: fp4_triton.dequantize(codes, scales, 16),
              lambda: fp4.dequantize(codes, scales, 16), n // 2 + n // 16 + 4 * n),
        _case("fp8/quantize_b32", lambda: fp4_triton.quantize_fp8(x, 32),
              lambda: fp4.quantize_fp8(x, 32), 2 * n + n + n // 32),
        _case("fp8/fake_quant_b32", lambda: fp4_triton.fake_quant_fp8(x, 32),
              lambda: fp4.fake_quant_fp8(x, 32), 4 * n),
        _case("fp8/dequantize_b32", lambda: fp4_triton.dequantize_fp8(values8, scales8, 32),
              lambda: fp4.dequantize_fp8(values8, scales8, 32), n + n // 32 + 4 * n),
    ]
    if sweep:
        for bpp, warps in ((64, 4), (256, 4), (128, 8), (64, 8)):
            out.append(_case(f"fp4/quantize_e4m3_b16/bpp{bpp}_w{warps}",
                             lambda bpp=bpp, w=warps: fp4_triton.quantize(x, 16, "e4m3", blocks_per_prog=bpp,
                                                                          num_warps=w),
                             lambda: None, 2 * n + n // 2 + n // 16, sweep=True))
    return out
