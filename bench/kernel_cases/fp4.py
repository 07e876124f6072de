"""Benchmark cases: FP4 / FP8 block quantisation (kernels/fp4_triton.py, kernels/fp8_triton.py) vs the PyTorch
references.

Main case (SPEC 1.4 main KV): FP4 quantise of bf16 latent, e4m3 scale per 16 (target >= 2.5 TB/s), at two sizes:
[32768, 512] (32 MiB, one 32K-token sequence: partly L2-resident on the H200 and launch/tail bound) and
[262144, 512] (256 MiB, 8 sequences: bandwidth bound). Bytes: 2 B read + 0.5 B codes + 1/16 B scale written per
element.

sweep=True adds the kernel variants (fp4_triton.VARIANTS) x a few (blocks per program, warps) for both sizes, named
"<case>/<variant>_bpp<P>_w<warps>", and CUDA-graph replays of the default launch ("/graph10": ten calls per replay),
which time the kernel without the host's launch path.
"""

from __future__ import annotations

import torch

from kernels import fp4, fp4_triton, fp8_triton

ROWS, DIM = 32768, 512
BIG_ROWS_FACTOR = 8  # the bandwidth-bound size: ROWS * 8 rows (a CPU dry run that shrinks ROWS shrinks it too)

DEVICE = "cuda"  # the runner times on the GPU; a CPU dry run (TRITON_INTERPRET=1, small sizes) patches it

# (blocks per program, warps) per sweep; 2048 // block blocks with 4 warps is the default.
_SWEEP_CONFIGS = ((128, 4), (256, 8), (64, 2))


def _case(name, fn_triton, fn_baseline, num_bytes, sweep=False):
    return {"name": name, "fn_triton": fn_triton, "fn_baseline": fn_baseline, "bytes": num_bytes, "sweep": sweep}


def _graph(fn, calls: int):
    """A CUDA graph of `calls` back-to-back calls of fn, returned as its replay (None off CUDA)."""
    if DEVICE != "cuda":
        return None
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def _fp4_bytes(n: int, block: int) -> int:
    return 2 * n + n // 2 + n // block


def cases(sweep: bool = False) -> list[dict]:
    x = torch.randn(ROWS, DIM, dtype=torch.bfloat16, device=DEVICE)
    x_big = torch.randn(ROWS * BIG_ROWS_FACTOR, DIM, dtype=torch.bfloat16, device=DEVICE)
    n, n_big = x.numel(), x_big.numel()
    codes, scales = fp4_triton.quantize(x, 16, "e4m3")
    values8, scales8 = fp8_triton.quantize_fp8(x, 32)
    out = [
        _case("fp4/quantize_e4m3_b16", lambda: fp4_triton.quantize(x, 16, "e4m3"),
              lambda: fp4.quantize(x, 16, "e4m3"), _fp4_bytes(n, 16)),
        _case("fp4/quantize_e4m3_b16_256MiB", lambda: fp4_triton.quantize(x_big, 16, "e4m3"),
              lambda: fp4.quantize(x_big, 16, "e4m3"), _fp4_bytes(n_big, 16)),
        _case("fp4/quantize_ue8m0_b32", lambda: fp4_triton.quantize(x, 32, "ue8m0"),
              lambda: fp4.quantize(x, 32, "ue8m0"), _fp4_bytes(n, 32)),
        _case("fp4/quantize_ue8m0_b32_256MiB", lambda: fp4_triton.quantize(x_big, 32, "ue8m0"),
              lambda: fp4.quantize(x_big, 32, "ue8m0"), _fp4_bytes(n_big, 32)),
        _case("fp4/fake_quant_e4m3_b16", lambda: fp4_triton.fake_quant(x, 16, "e4m3"),
              lambda: fp4.fake_quant(x, 16, "e4m3"), 4 * n),
        _case("fp4/dequantize_e4m3_b16", lambda: fp4_triton.dequantize(codes, scales, 16),
              lambda: fp4.dequantize(codes, scales, 16), n // 2 + n // 16 + 4 * n),
        _case("fp8/quantize_b32", lambda: fp8_triton.quantize_fp8(x, 32),
              lambda: fp4.quantize_fp8(x, 32), 2 * n + n + n // 32),
        _case("fp8/quantize_b32_256MiB", lambda: fp8_triton.quantize_fp8(x_big, 32),
              lambda: fp4.quantize_fp8(x_big, 32), 2 * n_big + n_big + n_big // 32),
        _case("fp8/fake_quant_b32", lambda: fp8_triton.fake_quant_fp8(x, 32),
              lambda: fp4.fake_quant_fp8(x, 32), 4 * n),
        _case("fp8/dequantize_b32", lambda: fp8_triton.dequantize_fp8(values8, scales8, 32),
              lambda: fp4.dequantize_fp8(values8, scales8, 32), n + n // 32 + 4 * n),
    ]
    if not sweep:
        return out
    for size, t, m in (("", x, n), ("_256MiB", x_big, n_big)):
        for variant in fp4_triton.VARIANTS:
            for bpp, warps in _SWEEP_CONFIGS:
                out.append(_case(
                    f"fp4/quantize_e4m3_b16{size}/{variant}_bpp{bpp}_w{warps}",
                    lambda t=t, v=variant, bpp=bpp, w=warps: fp4_triton.quantize(
                        t, 16, "e4m3", blocks_per_prog=bpp, num_warps=w, variant=v),
                    lambda: None, _fp4_bytes(m, 16), sweep=True))
        for variant in fp4_triton.VARIANTS:
            out.append(_case(
                f"fp4/quantize_ue8m0_b32{size}/{variant}_bpp64_w4",
                lambda t=t, v=variant: fp4_triton.quantize(t, 32, "ue8m0", blocks_per_prog=64, variant=v),
                lambda: None, _fp4_bytes(m, 32), sweep=True))
        for variant in fp4_triton.VARIANTS:
            out.append(_case(
                f"fp8/quantize_b32{size}/{variant}_bpp64_w4",
                lambda t=t, v=variant: fp8_triton.quantize_fp8(t, 32, blocks_per_prog=64, variant=v),
                lambda: None, 2 * m + m + m // 32, sweep=True))
        replay = _graph(lambda t=t: fp4_triton.quantize(t, 16, "e4m3"), 10)
        if replay is not None:
            out.append(_case(f"fp4/quantize_e4m3_b16{size}/graph10", replay, lambda: None,
                             10 * _fp4_bytes(m, 16), sweep=True))
    return out
