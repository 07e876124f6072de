"""Triton kernels of the FP8 training GEMMs (DeepSeek-V3's recipe): the 128 x 128 weight quantiser and the
block-scaled GEMM C = A B^T with fp32 accumulation. `kernels.fp8_gemm` (the reference, the autograd and the
dispatch) routes here with impl="triton"; the 1 x 128 activation quantiser is `kernels.fp8_triton.quantize_fp8(x,
128)`, which this module does not repeat.

Contract: `quantize_weight_fp8(w [G, N, K])` -> (values float8_e4m3fn [G, N, K], scales float8_e8m0fnu [G, N/128,
K/128]), bit-identical to `kernels.fp8_gemm.quantize_weight_fp8(impl="reference")`; `fp8_gemm(a, a_scales, b,
b_scales, ...)` -> C in the requested dtype, equal to dequantise-then-matmul in fp32 up to fp32 rounding (the
products of e4m3 values are exact in fp32; each 128-deep partial sum is scaled and added to an fp32 accumulator).
Shape legend: M rows (tokens), K contraction, N output channels, G groups (experts, or output-projection groups),
KB = K / 128, NB = N / 128.

Design and reasoning: docs/kernels.md#fp8-training-gemms
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import (
    FP8_AMAX_FLOOR,
    FP8_INV_MAX,
    FP8_MAX,
    check_device,
    e4m3_mag,
    e8m0_value,
    interpreting,
    magnitude,
    pow2_ceil,
    pow2_reciprocal,
)

__all__ = ["quantize_weight_fp8", "fp8_gemm"]

BLOCK = 128
"""the scale block: 1 x 128 for activations and gradients, 128 x 128 for weights"""

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _weight_quant_kernel(w_ptr, values_ptr, scales_ptr, K, KB, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """w [R, K] (R = G * N rows; a 128-row block never straddles two groups since N % 128 == 0) -> e4m3 bits uint8
    [R, K] and one e8m0 code uint8 [R / 128, KB] per 128 x 128 block, the rounding of kernels.fp8_triton."""
    rb, cb = tl.program_id(0), tl.program_id(1)
    rows = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    offs = rows[:, None] * K + cols[None, :]
    bits = tl.load(w_ptr + offs).to(tl.float32).to(tl.int32, bitcast=True)
    a = magnitude(bits)
    amax = tl.max(tl.max(a, axis=1), axis=0)
    # as the reference: multiply by fp32(1/448), power-of-two ceiling from the bits, exact reciprocal
    scale, code = pow2_ceil(tl.maximum(amax, FP8_AMAX_FLOOR) * FP8_INV_MAX)
    q = tl.minimum(a * pow2_reciprocal(code), FP8_MAX)
    tl.store(values_ptr + offs, (e4m3_mag(q) | ((bits >> 24) & 0x80)).to(tl.uint8))
    tl.store(scales_ptr + rb * KB + cb, code.to(tl.uint8))


def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [G, N, K] (bf16/fp16/fp32), N and K multiples of 128 -> (values e4m3 [G, N, K], scales e8m0 [G, N/128,
    K/128])."""
    if w.dim() != 3 or w.shape[1] % BLOCK or w.shape[2] % BLOCK:
        raise ValueError(f"quantize_weight_fp8: weight must be [G, N, K] with N and K multiples of {BLOCK}, "
                         f"got {tuple(w.shape)}")
    if w.dtype not in _OUT_DTYPES:
        raise TypeError(f"quantize_weight_fp8: weight must be bf16, fp16 or fp32, got {w.dtype}")
    check_device("w", "quantize_weight_fp8", w)
    g, n, k = w.shape
    values = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scales = torch.empty(g, n // BLOCK, k // BLOCK, dtype=torch.float8_e8m0fnu, device=w.device)
    if w.numel():
        _weight_quant_kernel[(g * n // BLOCK, k // BLOCK)](
            w.detach(), values.view(torch.uint8), scales.view(torch.uint8), k, k // BLOCK,
            BLOCK_R=BLOCK, BLOCK_C=BLOCK, num_warps=8)
    return values, scales


@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, tile_group_ptr, tile_row0_ptr, tile_end_ptr,
                     M, N, K, LDA, LDC,
                     GROUPED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
    """C = A B^T, block-scaled. A: e4m3 rows with row stride LDA, one e8m0 scale per row and 128 channels (row
    stride LDA / 128); B: e4m3 [G, N, K], one e8m0 scale per 128 x 128 block [G, N/128, K/128].

    GROUPED: rows are split among the G groups (experts, row tiles from the tile map: tile_group < 0 is idle);
    else the grid's third axis is the group, and group g reads A's columns g*K .. and writes C's columns g*N ..
    (a block-diagonal weight: the grouped output projection; G = 1 is the plain linear)."""
    pid, pid_n = tl.program_id(0), tl.program_id(1)
    if GROUPED:
        g = tl.load(tile_group_ptr + pid)
        row0 = tl.load(tile_row0_ptr + pid)
        row_end = tl.load(tile_end_ptr + pid)
        col_a, col_c = 0, 0
    else:
        g = tl.program_id(2)
        # grouped launch order over (m, n) tiles: GROUP_M row tiles share each B column panel in L2
        num_m, num_n = tl.cdiv(M, BLOCK_M), tl.num_programs(1)
        lin = pid * num_n + pid_n
        first_m = (lin // (GROUP_M * num_n)) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (lin % (GROUP_M * num_n)) % size_m
        pid_n = (lin % (GROUP_M * num_n)) // size_m
        row0 = pid_m * BLOCK_M
        row_end = M
        col_a, col_c = g * K, g * N
    if g >= 0:
        kb_count = K // BLOCK_K
        rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        live = rows < row_end
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # BLOCK_N divides 128, so one weight scale per K step
        kk = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None] * LDA + col_a + kk[None, :]
        b_ptrs = b_ptr + g.to(tl.int64) * N * K + cols[:, None].to(tl.int64) * K + kk[None, :]
        as_ptrs = as_ptr + rows * (LDA // BLOCK_K) + col_a // BLOCK_K
        bs_ptrs = bs_ptr + (g * (N // BLOCK_K) + pid_n * BLOCK_N // BLOCK_K) * kb_count
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, kb_count):
            a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
            b = tl.load(b_ptrs)
            sa = e8m0_value(tl.load(as_ptrs + kb, mask=live, other=127).to(tl.int32))
            sb = e8m0_value(tl.load(bs_ptrs + kb).to(tl.int32))
            # DeepSeek-V3's promotion: each 128-deep partial sum leaves the tensor core, is scaled in fp32 and
            # added to the fp32 accumulator (exact products; no long low-precision accumulation)
            part = tl.dot(a, tl.trans(b))
            acc += part * (sa[:, None] * sb)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        c_ptrs = c_ptr + rows[:, None] * LDC + col_c + cols[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=live[:, None])


def _configs() -> list[dict]:
    """Launch settings: small tiles under the CPU interpreter (speed), the H100 tiles otherwise."""
    if interpreting():
        return [dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=1)]
    return [dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4),
            dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=4),
            dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=5),
            dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=5)]


_TUNED: dict[tuple, dict] = {}
"""(mode, M bucket, N, K, G, device) -> the fastest of `_configs()`, timed once per shape (GPU only)."""


def tile_map(group_ends: torch.Tensor, num_rows: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """group_ends [G] int32 cumulative row ends -> (group, first row, end row) int32 [cdiv(M, block_m) + G] of each
    row tile, group -1 for the idle tail: a group's rows are cut into tiles of block_m from its first row. No host
    sync: the tile count is the static bound cdiv(M, block_m) + G."""
    ends = group_ends.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + block_m - 1) // block_m  # [G]
    cum = tiles.cumsum(0)
    t = torch.arange(triton.cdiv(num_rows, block_m) + ends.numel(), device=ends.device)
    group = torch.searchsorted(cum, t, right=True)  # [T]; G past the last tile
    valid = group < ends.numel()
    gc = group.clamp_max(ends.numel() - 1)
    row0 = starts[gc] + (t - (cum[gc] - tiles[gc])) * block_m
    return (torch.where(valid, gc, -1).to(torch.int32), row0.to(torch.int32), ends[gc].to(torch.int32))


def _launch(cfg: dict, a, a_scales, b, b_scales, c, group_ends, m, n, k, lda, ldc, g):
    grouped = group_ends is not None
    if grouped:
        maps = tile_map(group_ends, m, cfg["BLOCK_M"])
        grid = (maps[0].numel(), n // cfg["BLOCK_N"])
    else:
        maps = (c, c, c)  # unused pointers
        grid = (triton.cdiv(m, cfg["BLOCK_M"]), n // cfg["BLOCK_N"], g)
    _fp8_gemm_kernel[grid](a, a_scales.view(torch.uint8), b, b_scales.view(torch.uint8), c, *maps, m, n, k, lda, ldc,
                           GROUPED=grouped, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=BLOCK,
                           GROUP_M=8, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _pick(key: tuple, run) -> dict:
    """The fastest launch setting for `key`, timed on first use with CUDA events (the outputs are overwritten by
    the real launch afterwards); the interpreter's single setting without timing."""
    configs = _configs()
    if len(configs) == 1:
        return configs[0]
    if key not in _TUNED:
        times = []
        for cfg in configs:
            run(cfg)  # compile and warm
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):
                run(cfg)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        _TUNED[key] = configs[min(range(len(configs)), key=times.__getitem__)]
    return _TUNED[key]


def fp8_gemm(a: torch.Tensor, a_scales: torch.Tensor, b: torch.Tensor, b_scales: torch.Tensor, *,
             group_ends: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Block-scaled C = A B^T with fp32 accumulation.

    a e4m3 [M, G*K] (G*K when block-diagonal) and a_scales e8m0 [M, G*K/128]; b e4m3 [G, N, K], b_scales e8m0
    [G, N/128, K/128]. group_ends None: block-diagonal over the G groups (C [M, G*N]; G = 1 is a plain linear);
    group_ends [G] int32 (rows sorted by group, the last end = M): row-grouped (C [M, N], rows of group g times
    B[g]^T). N and K must be multiples of 128. Returns C in out_dtype (bf16, fp16 or fp32)."""
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fp8_gemm: a and b must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    if a_scales.dtype != torch.float8_e8m0fnu or b_scales.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"fp8_gemm: scales must be float8_e8m0fnu, got {a_scales.dtype} and {b_scales.dtype}")
    if b.dim() != 3 or a.dim() != 2:
        raise ValueError(f"fp8_gemm: a must be [M, K] and b [G, N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    g, n, k = b.shape
    m = a.shape[0]
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"fp8_gemm: N={n} and K={k} must be multiples of {BLOCK}")
    width = k if group_ends is not None else g * k
    if a.shape[1] != width or tuple(a_scales.shape) != (m, width // BLOCK):
        raise ValueError(f"fp8_gemm: a {tuple(a.shape)} / a_scales {tuple(a_scales.shape)} do not fit b "
                         f"{tuple(b.shape)} (want [M, {width}] and [M, {width // BLOCK}])")
    if tuple(b_scales.shape) != (g, n // BLOCK, k // BLOCK):
        raise ValueError(f"fp8_gemm: b_scales {tuple(b_scales.shape)}, want {(g, n // BLOCK, k // BLOCK)}")
    if group_ends is not None and (group_ends.shape != (g,) or group_ends.dtype != torch.int32):
        raise ValueError(f"fp8_gemm: group_ends must be int32 [{g}], got {group_ends.dtype} "
                         f"{tuple(group_ends.shape)}")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"fp8_gemm: out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    check_device("a, b and their scales", "fp8_gemm", a, a_scales, b, b_scales,
                 *(() if group_ends is None else (group_ends,)))
    c = torch.empty(m, n if group_ends is not None else g * n, dtype=out_dtype, device=a.device)
    if m == 0 or g == 0:
        return c.zero_()
    lda, ldc = a.shape[1], c.shape[1]
    key = (group_ends is not None, 1 << max(m - 1, 0).bit_length(), n, k, g, a.device)

    def run(cfg):
        _launch(cfg, a, a_scales, b, b_scales, c, group_ends, m, n, k, lda, ldc, g)

    run(_pick(key, run))
    return c
