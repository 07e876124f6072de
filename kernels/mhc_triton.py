"""Triton kernels for the single-pass mHC step (SPEC 1.6, REFERENCE A6), forward and backward.

Contract: the PyTorch reference is `model.mhc.single_pass` (and `unfused_step`, the same function). The kernels take
tensors only: `mhc_step` the flat activations y [N, D], S [N, n, D], the per-token mix matrix W [N, n+1, n+1] fp32
and the next site's fn [M, n*D] or None -> (S' [N, n, D], x [N, D], sum_sq [N], raw [N, M]; the last two None
without fn), gradients reaching y, S, W and fn; `next_coeffs` (kernels.mhc_coeffs_triton) the statistics and
the site's scale, base and settings. model.kernels.mhc_single_pass builds W from the coefficients
(`model.mhc.mix_matrix`) and reads the site's parameters, so the composition has model.mhc.single_pass's
signature and returns. The statistics come from the
rounded, stored S', as in the reference; streams are bf16 or fp32.

Design and reasoning: docs/kernels.md#single-pass-mhc-kernels
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import bf16_bits, bf16_round, check_device, interpreting

__all__ = ["mhc_step", "mhc_step_fwd", "mhc_step_bwd", "FWD_CONFIGS"]


# ------------------------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _mma(a, b, acc, GPU: tl.constexpr):
    """acc += a @ b. Operands hold bf16-exact values: bf16 tensor-core MMA when compiled for the GPU, fp32 in
    the interpreter (whose bf16 arithmetic is wrong)."""
    if GPU:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _split_dot(a_hi, a_lo, b_hi, b_lo, acc, A_LO: tl.constexpr, B_LO: tl.constexpr, GPU: tl.constexpr):
    """acc += (a_hi + a_lo) @ (b_hi + b_lo) without the lo @ lo term (a bf16x3 product, ~2^-16 relative)."""
    acc = _mma(a_hi, b_hi, acc, GPU)
    if A_LO:
        acc = _mma(a_lo, b_hi, acc, GPU)
    if B_LO:
        acc = _mma(a_hi, b_lo, acc, GPU)
    return acc


@triton.jit
def _layout_fence(x, ON: tl.constexpr):
    """Identity the compiler cannot see through (GPU only; the interpreter cannot run PTX).

    Without it Triton hoists the MMA-operand layout of a dot input up through the elementwise code that made
    it, so the whole mix is computed a second time in that layout: twice the work and heavy spills.
    """
    if ON:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1)
    else:
        return x


@triton.jit
def _load_f32(ptr, mask):
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _round_bf16(x, GPU: tl.constexpr):
    """fp32 -> fp32 holding the nearest bf16 value: one cvt on the GPU, bit arithmetic in the interpreter."""
    if GPU:
        return x.to(tl.bfloat16).to(tl.float32)
    else:
        return bf16_round(x)


@triton.jit
def _store_rounded(ptr, val, mask, BF16: tl.constexpr, GPU: tl.constexpr, policy: tl.constexpr):
    """Store fp32 `val` into a bf16 or fp32 tensor; return the value as stored (fp32).

    bf16 tensors arrive as bf16 pointers on the GPU (hardware round to nearest even) and as their int16 bits in
    the interpreter, which rounds bf16 casts wrongly (`bf16_bits` does it there).
    """
    if BF16:
        if GPU:
            rounded = val.to(tl.bfloat16)
            tl.store(ptr, rounded, mask=mask, eviction_policy=policy)
            return rounded.to(tl.float32)
        else:
            bits = bf16_bits(val)
            tl.store(ptr, bits.to(tl.int16), mask=mask, eviction_policy=policy)
            return (bits << 16).to(tl.float32, bitcast=True)
    else:
        tl.store(ptr, val, mask=mask, eviction_policy=policy)
        return val


@triton.jit
def _load_mix(w_ptr, tok, t_ok, NW: tl.constexpr):
    """W [N, NW, NW] -> tuple of NW * NW columns [BLOCK_T, 1]: w[i * NW + j] = weight of input j in output i."""
    w = ()
    for i in tl.static_range(NW * NW):
        w = w + (tl.load(w_ptr + tok * (NW * NW) + i, mask=t_ok, other=0.0)[:, None],)
    return w


@triton.jit
def _load_inputs(y_ptr, s_ptr, tok, d, m2, dim, N: tl.constexpr, STREAM: tl.constexpr = False):
    """(y, S_0, .., S_{n-1}) tiles [BLOCK_T, BLOCK_D] in their storage dtype (half the registers of fp32;
    `_mix` widens them at each use, which costs one shift for bf16). STREAM: read-once data, evicted first
    from L2 so that fn^T (re-read by every token block) stays resident."""
    policy: tl.constexpr = "evict_first" if STREAM else ""
    ins = (tl.load(y_ptr + tok[:, None] * dim + d[None, :], mask=m2, other=0.0, eviction_policy=policy),)
    for j in tl.static_range(N):
        ins = ins + (tl.load(s_ptr + (tok[:, None] * N + j) * dim + d[None, :], mask=m2, other=0.0,
                             eviction_policy=policy),)
    return ins


@triton.jit
def _mix(w, ins, i: tl.constexpr, NW: tl.constexpr):
    """Output i = sum_j W[i, j] input_j, fp32."""
    out = w[i * NW] * ins[0].to(tl.float32)
    for j in tl.static_range(1, NW):
        out += w[i * NW + j] * ins[j].to(tl.float32)
    return out


# ------------------------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _mhc_fwd_kernel(y_ptr, s_ptr, w_ptr, fnt_ptr,
                    s_out_ptr, x_out_ptr, sumsq_ptr, raw_ptr,
                    num_tokens, dim, chunk,
                    N: tl.constexpr, STATS: tl.constexpr, S_BF16: tl.constexpr, GPU: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    STREAM: tl.constexpr, SQ_TILE: tl.constexpr):
    """Program (token block, D chunk): channels [split * chunk, (split + 1) * chunk) of BLOCK_T tokens.

    With one chunk (the whole D) the statistics are complete here; with several, each program writes its
    chunk's partial sum_sq / raw to row `split` of [splits, N] / [splits, N, BLOCK_M] and the host sums them.
    SQ_TILE: sum of squares kept per element and reduced once after the loop (no cross-lane reduction per tile).
    """
    NW: tl.constexpr = N + 1
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    split = tl.program_id(1)
    d_begin = split * chunk
    d_end = tl.minimum(d_begin + chunk, dim)
    t_ok = tok < num_tokens
    w = _load_mix(w_ptr, tok, t_ok, NW)
    cols = tl.arange(0, BLOCK_M)
    sumsq = tl.zeros([BLOCK_T], dtype=tl.float32)
    sq_tile = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    raw = tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32)
    policy: tl.constexpr = "evict_first" if STREAM else ""
    fn_policy: tl.constexpr = "evict_last" if STREAM else ""
    for d0 in range(d_begin, d_end, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)  # [BLOCK_D]
        d_ok = d < d_end
        m2 = t_ok[:, None] & d_ok[None, :]
        ins = _load_inputs(y_ptr, s_ptr, tok, d, m2, dim, N, STREAM)
        for i in tl.static_range(N):
            dst = s_out_ptr + (tok[:, None] * N + i) * dim + d[None, :]
            stored = _store_rounded(dst, _mix(w, ins, i, NW), m2, S_BF16, GPU, policy)  # [BLOCK_T, BLOCK_D]
            if STATS:
                # The next site sees the stored (rounded) stream, still in registers: no second read.
                if SQ_TILE:
                    sq_tile += stored * stored
                else:
                    sumsq += tl.sum(stored * stored, axis=1)
                # fn^T rows of this stream and tile, [fn_hi | fn_lo] side by side: [BLOCK_D, BLOCK_M]
                f_offs = (i * dim + d)[:, None] * BLOCK_M + cols[None, :]
                fn_t = tl.load(fnt_ptr + f_offs, mask=d_ok[:, None], other=0.0, eviction_policy=fn_policy)
                stored = _layout_fence(stored, GPU)
                if S_BF16:  # exact in one bf16 operand
                    raw = _mma(stored, fn_t, raw, GPU)
                else:  # fp32 streams: hi and lo bf16 parts
                    s_hi = _round_bf16(stored, GPU)
                    raw = _mma(stored - s_hi, fn_t, _mma(s_hi, fn_t, raw, GPU), GPU)
        # x = collapse of S' with the lagged pre, folded into W's last row (mix_matrix).
        _store_rounded(x_out_ptr + tok[:, None] * dim + d[None, :], _mix(w, ins, N, NW), m2, S_BF16, GPU, policy)
    if STATS:
        if SQ_TILE:
            sumsq = tl.sum(sq_tile, axis=1)
        part = split.to(tl.int64) * num_tokens
        tl.store(sumsq_ptr + part + tok, sumsq, mask=t_ok)
        tl.store(raw_ptr + (part + tok[:, None]) * BLOCK_M + cols[None, :], raw, mask=t_ok[:, None])


# ------------------------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _mhc_bwd_kernel(y_ptr, s_ptr, w_ptr, fn_hi_ptr, fn_lo_ptr,
                    g_snew_ptr, g_x_ptr, g_sumsq_ptr, g_raw_hi_ptr, g_raw_lo_ptr,
                    g_y_ptr, g_s_ptr, g_w_ptr,
                    num_tokens, dim, chunk,
                    N: tl.constexpr, STATS: tl.constexpr, Y_BF16: tl.constexpr, S_BF16: tl.constexpr,
                    GPU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_W: tl.constexpr):
    """Program (token block, D chunk): the input gradients of channels [split * chunk, (split + 1) * chunk) and
    this chunk's part of dL/dW, written to row `split` of g_w [splits, N, BLOCK_W] (the host sums the rows)."""
    NW: tl.constexpr = N + 1
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    d_begin = split * chunk
    d_end = tl.minimum(d_begin + chunk, dim)
    t_ok = tok < num_tokens
    w = _load_mix(w_ptr, tok, t_ok, NW)
    cols = tl.arange(0, BLOCK_M)
    if STATS:
        gsq2 = 2.0 * tl.load(g_sumsq_ptr + tok, mask=t_ok, other=0.0)[:, None]
        gr_offs = tok[:, None] * BLOCK_M + cols[None, :]
        g_raw_hi = tl.load(g_raw_hi_ptr + gr_offs, mask=t_ok[:, None], other=0.0)  # [BLOCK_T, BLOCK_M]
        g_raw_lo = tl.load(g_raw_lo_ptr + gr_offs, mask=t_ok[:, None], other=0.0)
    wcol = tl.arange(0, BLOCK_W)[None, :]
    g_w = tl.zeros([BLOCK_T, BLOCK_W], dtype=tl.float32)  # dL/dW, flattened i * NW + j
    for d0 in range(d_begin, d_end, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m2 = t_ok[:, None] & (d < d_end)[None, :]
        ins = _load_inputs(y_ptr, s_ptr, tok, d, m2, dim, N, False)
        g_outs = ()
        for i in tl.static_range(N):
            g = _load_f32(g_snew_ptr + (tok[:, None] * N + i) * dim + d[None, :], m2)
            if STATS:
                s_new = _mix(w, ins, i, NW)
                if S_BF16:
                    s_new = _round_bf16(s_new, GPU)  # the statistics saw the stored value
                f_offs = cols[:, None] * (N * dim) + (i * dim + d)[None, :]  # fn [BLOCK_M, BLOCK_D]
                f_ok = (d < d_end)[None, :]
                fn_hi = tl.load(fn_hi_ptr + f_offs, mask=f_ok, other=0.0)
                fn_lo = tl.load(fn_lo_ptr + f_offs, mask=f_ok, other=0.0)
                proj = _split_dot(g_raw_hi, g_raw_lo, fn_hi, fn_lo, tl.zeros_like(g), True, True, GPU)
                g += gsq2 * s_new + _layout_fence(proj, GPU)
            g_outs = g_outs + (g,)
        g_outs = g_outs + (_load_f32(g_x_ptr + tok[:, None] * dim + d[None, :], m2),)
        # Input gradients: the transpose of the mix. Stored in the inputs' dtypes.
        for j in tl.static_range(NW):
            g_in = w[j] * g_outs[0]
            for i in tl.static_range(1, NW):
                g_in += w[i * NW + j] * g_outs[i]
            if j == 0:
                _store_rounded(g_y_ptr + tok[:, None] * dim + d[None, :], g_in, m2, Y_BF16, GPU, "")
            else:
                _store_rounded(g_s_ptr + (tok[:, None] * N + (j - 1)) * dim + d[None, :], g_in, m2, S_BF16, GPU, "")
        # Mixing-weight gradients, reduced over this D tile into their column of g_w.
        for i in tl.static_range(NW):
            for j in tl.static_range(NW):
                part = tl.sum(g_outs[i] * ins[j].to(tl.float32), axis=1)[:, None]
                g_w += tl.where(wcol == i * NW + j, part, 0.0)
    g_w_rows = g_w_ptr + (split.to(tl.int64) * num_tokens + tok[:, None]) * (NW * NW)
    tl.store(g_w_rows + wcol, g_w, mask=t_ok[:, None] & (wcol < NW * NW))


@triton.jit
def _mhc_fn_grad_kernel(g_raw_hi_ptr, g_raw_lo_ptr, s_new_ptr, part_ptr,
                        num_tokens, width, tokens_per_split,
                        S_BF16: tl.constexpr, GPU: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr):
    """part[split] [BLOCK_M, width] = g_raw^T @ flatten(S') over this split's tokens (width = n * D)."""
    c = tl.program_id(0).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    t_begin = split * tokens_per_split
    t_end = tl.minimum(t_begin + tokens_per_split, num_tokens)
    acc = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    for t0 in range(t_begin, t_end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        t_ok = t < t_end
        a_offs = t[None, :] * BLOCK_M + rows[:, None]  # g_raw^T tile [BLOCK_M, BLOCK_T]
        a_hi = tl.load(g_raw_hi_ptr + a_offs, mask=t_ok[None, :], other=0.0)
        a_lo = tl.load(g_raw_lo_ptr + a_offs, mask=t_ok[None, :], other=0.0)
        b = _load_f32(s_new_ptr + t[:, None] * width + c[None, :], t_ok[:, None] & (c < width)[None, :])
        b_hi = _round_bf16(b, GPU)
        acc = _split_dot(a_hi, a_lo, b_hi, b - b_hi, acc, True, not S_BF16, GPU)
    part = part_ptr + split.to(tl.int64) * BLOCK_M * width
    tl.store(part + rows[:, None] * width + c[None, :], acc, mask=(c < width)[None, :])


# ------------------------------------------------------------------------------------------------------------
# Host wrappers


_DTYPES = (torch.bfloat16, torch.float32)


def _split_bf16(t: torch.Tensor, gpu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 t -> (hi, lo) with hi = bf16(t), lo = bf16(t - hi); fp32 copies of them for the interpreter."""
    hi = t.to(torch.bfloat16)
    lo = (t - hi.float()).to(torch.bfloat16)
    return (hi, lo) if gpu else (hi.float(), lo.float())


def _out(t: torch.Tensor, gpu: bool) -> torch.Tensor:
    """Output tensors as the kernels write them: bf16 through its int16 bits in the interpreter."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 and not gpu else t


def _d_chunks(D: int, split_d: int, block_d: int) -> tuple[int, int]:
    """D split over at most split_d programs -> (channels per chunk, chunks). Chunks are whole tiles; a split that
    would start past D is dropped (small D in tests)."""
    chunk = triton.cdiv(triton.cdiv(D, split_d), block_d) * block_d
    return chunk, max(1, triton.cdiv(D, chunk))


def _block_m(num_logits: int) -> int:
    return max(16, triton.next_power_of_2(num_logits))  # tl.dot needs every dim >= 16


def _check_step(y: torch.Tensor, S: torch.Tensor, mix: torch.Tensor, fn: torch.Tensor | None, fn_name: str):
    if S.dim() != 3:
        raise ValueError(f"{fn_name}: S must be [N, n, D], got shape {tuple(S.shape)}")
    N, n, D = S.shape
    if y.shape != (N, D):
        raise ValueError(f"{fn_name}: y must be [N, D] = {(N, D)}, got {tuple(y.shape)}")
    if mix.shape != (N, n + 1, n + 1) or mix.dtype != torch.float32:
        raise ValueError(f"{fn_name}: mix must be float32 [N, n+1, n+1] = {(N, n + 1, n + 1)}, "
                         f"got {mix.dtype} {tuple(mix.shape)}")
    for name, t in (("y", y), ("S", S)):
        if t.dtype not in _DTYPES:
            raise TypeError(f"{fn_name}: {name} must be bfloat16 or float32, got {t.dtype}")
    tensors = [y, S, mix]
    if fn is not None:
        M = 2 * n + n * n
        if fn.shape != (M, n * D) or fn.dtype != torch.float32:
            raise ValueError(f"{fn_name}: fn must be float32 [2n + n^2, n * D] = {(M, n * D)}, "
                             f"got {fn.dtype} {tuple(fn.shape)}")
        tensors.append(fn)
    check_device("y, S, mix and fn", fn_name, *tensors)
    return N, n, D


# Forward tile configurations, by name (the bench sweeps them; `mhc_step_fwd(..., config=name)` or keywords).
#   block_t x block_d  tokens x channels per tile; each program walks its D chunk tile by tile
#   split_d            D chunks per token block (grid axis 1): more, shorter programs; partial statistics
#   stream             L2 hints: activations evict_first, fn^T evict_last
#   sq_tile            sum of squares accumulated per element, reduced once at the end
# Offline sm_90 compiles with Triton 3.6 (ptxas -v): 64-token tiles use wgmma and sit at 255 registers (2 programs
# per SM); 32-token tiles use mma.sync at ~170 registers (3 per SM by registers); 4 stages of 64 x 32 spill.
# The session-3 H200 sweep ran 18 configurations (0.787 to 1.28 ms, BENCHMARKS.md); kept are its best (the
# default), the previous default, that one with each switch on alone, and the smallest tile, so the sweep and the
# tests reach every code path (split_d, stream, sq_tile) at least once.
def _cfg(t, d, w, s, **extra):
    return dict(block_t=t, block_d=d, num_warps=w, num_stages=s, **extra)


FWD_CONFIGS: dict[str, dict] = {
    "t32_d64_w8_s4": _cfg(32, 64, 8, 4),  # the sweep's best, FWD_DEFAULT
    "t64_d32_w4_s3": _cfg(64, 32, 4, 3),  # the previous default: 0.72 ms in the first sweep, 0.85 ms in session 3
    "t64_d32_w4_s3_split2": _cfg(64, 32, 4, 3, split_d=2),
    "t64_d32_w4_s3_stream": _cfg(64, 32, 4, 3, stream=True),
    "t64_d32_w4_s3_sq": _cfg(64, 32, 4, 3, sq_tile=True),
    "t16_d32_w2_s4": _cfg(16, 32, 2, 4),  # the smallest tile
}
FWD_DEFAULT = "t32_d64_w8_s4"  # 0.787 ms in the session-3 H200 sweep (t64_d32_w4_s3: 0.85 ms); BENCHMARKS.md


def mhc_step_fwd(y: torch.Tensor, S: torch.Tensor, mix: torch.Tensor, fn: torch.Tensor | None, *,
                 config: str | None = None, block_t: int | None = None, block_d: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None, split_d: int | None = None,
                 stream: bool | None = None, sq_tile: bool | None = None,
                 out: tuple[torch.Tensor, ...] | None = None):
    """y [N, D], S [N, n, D], mix [N, n+1, n+1] fp32, fn [M, n*D] fp32 or None ->
    (S' [N, n, D], x [N, D], sum_sq [N] fp32, raw [N, M] fp32); the last two are None when fn is None.

    Tiles: `FWD_CONFIGS[config]` (default `FWD_DEFAULT`), any keyword given overriding it. The grid is
    (token blocks) x split_d; each program streams its D chunk once (n + 1 tile reads, n + 1 tile writes).

    `out` = (S', x, sum_sq, raw) buffers to write into (tests poison them). No autograd: see `mhc_step`.
    """
    N, n, D = _check_step(y, S, mix, fn, "mhc_step_fwd")
    if config is not None and config not in FWD_CONFIGS:
        raise ValueError(f"mhc_step_fwd: config must be one of {sorted(FWD_CONFIGS)}, got {config!r}")
    cfg = {"split_d": 1, "stream": False, "sq_tile": False, **FWD_CONFIGS[config or FWD_DEFAULT]}
    given = dict(block_t=block_t, block_d=block_d, num_warps=num_warps, num_stages=num_stages, split_d=split_d,
                 stream=stream, sq_tile=sq_tile)
    cfg.update({k: v for k, v in given.items() if v is not None})
    block_d = cfg["block_d"]
    chunk, splits = _d_chunks(D, cfg["split_d"], block_d)
    stats = fn is not None
    M = 2 * n + n * n
    if out is None:
        s_new, x = torch.empty_like(S), torch.empty_like(y, dtype=S.dtype)
        sumsq = torch.empty(N, dtype=torch.float32, device=S.device) if stats else None
        raw = torch.empty(N, M, dtype=torch.float32, device=S.device) if stats else None
    else:
        s_new, x, sumsq, raw = out
        if s_new.shape != S.shape or s_new.dtype != S.dtype or x.shape != y.shape or x.dtype != S.dtype:
            raise ValueError("mhc_step_fwd: out S' and x must match S's shape and y's shape, in S's dtype")
        if stats and (sumsq.shape != (N,) or raw.shape != (N, M)):
            raise ValueError(f"mhc_step_fwd: out sum_sq and raw must be [N] and [N, M] = {(N, M)}")
        check_device("out", "mhc_step_fwd", S, *(t for t in out if t is not None))
    gpu = not interpreting()
    half = _block_m(M)
    if stats:
        # fn^T split in bf16 halves side by side, [fn_hi | fn_lo]: [n*D, 2 * half] (a few MB, L2-resident), so
        # one MMA per stream and tile gives both products; their halves are added once, below.
        fnt = torch.zeros(n * D, 2, half, dtype=torch.float32, device=S.device)
        fnt[:, 0, :M] = fn.t()
        fnt[:, 1] = fnt[:, 0] - fnt[:, 0].to(torch.bfloat16).float()
        fnt = fnt.flatten(1).to(torch.bfloat16) if gpu else fnt.flatten(1).to(torch.bfloat16).float()
        raw2 = torch.empty(splits, N, 2 * half, dtype=torch.float32, device=S.device)
        sumsq_part = sumsq if splits == 1 else torch.empty(splits, N, dtype=torch.float32, device=S.device)
    else:
        fnt = raw2 = sumsq_part = mix  # unused
    if N:
        _mhc_fwd_kernel[(triton.cdiv(N, cfg["block_t"]), splits)](
            y, S, mix, fnt, _out(s_new, gpu), _out(x, gpu), sumsq_part, raw2, N, D, chunk,
            N=n, STATS=stats, S_BF16=S.dtype == torch.bfloat16, GPU=gpu,
            BLOCK_T=cfg["block_t"], BLOCK_D=block_d, BLOCK_M=2 * half, STREAM=cfg["stream"],
            SQ_TILE=cfg["sq_tile"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if stats:
        if splits == 1:
            torch.add(raw2[0, :, :M], raw2[0, :, half:half + M], out=raw)
        else:  # the chunks' partials, hi and lo halves: one deterministic reduction of [splits, N, 2, M]
            torch.sum(raw2.view(splits, N, 2, half)[..., :M], dim=(0, 2), out=raw)
            torch.sum(sumsq_part, dim=0, out=sumsq)
    return s_new, x, sumsq, raw


def mhc_step_bwd(y, S, mix, fn, s_new, g_snew, g_x, g_sumsq=None, g_raw=None, *,
                 block_t: int = 16, block_d: int = 64, num_warps: int = 4, num_stages: int = 3,
                 split_d: int = 1, fn_splits: int | None = None):
    """Gradients of `mhc_step_fwd`: (dL/dy, dL/dS, dL/dmix [N, n+1, n+1] fp32, dL/dfn or None).

    g_sumsq [N] and g_raw [N, M] are needed (and used) only when fn is given; s_new is the forward's S'.
    split_d > 1 spreads each token block's channels over that many programs (more programs in flight for small N x
    D; each writes its chunk's part of dL/dmix, summed here in a fixed order). The tile keywords are the sweep's
    (bench/mhc_shapes.py); the defaults are the flagship shape's.
    """
    N, n, D = _check_step(y, S, mix, fn, "mhc_step_bwd")
    stats = fn is not None
    M, NW = 2 * n + n * n, n + 1
    for name, g, ref in (("g_snew", g_snew, S), ("g_x", g_x, y)):
        if g.shape != ref.shape:
            raise ValueError(f"mhc_step_bwd: {name} must have shape {tuple(ref.shape)}, got {tuple(g.shape)}")
    g_snew, g_x = g_snew.contiguous(), g_x.contiguous()
    gpu = not interpreting()
    block_m = _block_m(M)
    g_y, g_s = torch.empty_like(y), torch.empty_like(S)
    chunk, splits = _d_chunks(D, split_d, block_d)
    g_mix = torch.empty(N, NW, NW, dtype=torch.float32, device=S.device)
    g_mix_part = g_mix if splits == 1 else torch.empty(splits, N, NW, NW, dtype=torch.float32, device=S.device)
    g_fn = None
    if stats:
        fn_pad = torch.zeros(block_m, n * D, dtype=torch.float32, device=S.device)
        fn_pad[:M] = fn
        fn_hi, fn_lo = _split_bf16(fn_pad, gpu)
        g_raw_pad = torch.zeros(N, block_m, dtype=torch.float32, device=S.device)
        g_raw_pad[:, :M] = g_raw
        g_raw_hi, g_raw_lo = _split_bf16(g_raw_pad, gpu)
        g_sumsq = g_sumsq.float().contiguous()
    else:
        fn_hi = fn_lo = g_raw_hi = g_raw_lo = g_sumsq = mix  # unused
    check_device("gradients", "mhc_step_bwd", g_snew, g_x, g_sumsq)
    if N:
        _mhc_bwd_kernel[(triton.cdiv(N, block_t), splits)](
            y, S, mix, fn_hi, fn_lo, g_snew, g_x, g_sumsq, g_raw_hi, g_raw_lo,
            _out(g_y, gpu), _out(g_s, gpu), g_mix_part, N, D, chunk,
            N=n, STATS=stats, Y_BF16=y.dtype == torch.bfloat16, S_BF16=S.dtype == torch.bfloat16,
            GPU=gpu, BLOCK_T=block_t, BLOCK_D=block_d, BLOCK_M=block_m,
            BLOCK_W=triton.next_power_of_2(NW * NW), num_warps=num_warps, num_stages=num_stages)
        if splits > 1:
            torch.sum(g_mix_part, dim=0, out=g_mix)
    if stats:
        # Split-K over tokens; the few partials are summed in fp32 here (deterministic, no atomics).
        block_c = 128
        width = n * D
        splits = fn_splits or max(1, min(16, triton.cdiv(N, 1024)))
        per_split = triton.cdiv(max(N, 1), splits)
        part = torch.empty(splits, block_m, width, dtype=torch.float32, device=S.device)
        _mhc_fn_grad_kernel[(triton.cdiv(width, block_c), splits)](
            g_raw_hi, g_raw_lo, s_new, part, N, width, per_split,
            S_BF16=S.dtype == torch.bfloat16, GPU=gpu,
            BLOCK_T=32, BLOCK_C=block_c, BLOCK_M=block_m, num_warps=4)
        g_fn = part.sum(0)[:M]
    return g_y, g_s, g_mix, g_fn


# The step's two directions as custom operators: compiled graphs call each as one opaque node. Traced as user
# Triton kernels instead, Inductor would analyse the kernels for the inputs they write, fail on `_layout_fence`'s
# inline PTX (it is not pure, on purpose) and then assume every input written: a copy of y, S and the mix before
# every launch. The operators write none of their inputs, which `mutates_args=()` states. Without fn the
# statistics are empty tensors (an operator returns tensors).


@torch.library.custom_op("cedar::mhc_step_fwd", mutates_args=())
def _fwd_op(y: torch.Tensor, S: torch.Tensor, mix: torch.Tensor, fn: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    s_new, x, sumsq, raw = mhc_step_fwd(y, S, mix, fn)
    if fn is None:
        sumsq, raw = mix.new_empty(0), mix.new_empty(0)  # two tensors: an operator's outputs may not alias
    return s_new, x, sumsq, raw


@_fwd_op.register_fake
def _(y, S, mix, fn):
    s_new, x = torch.empty_like(S), torch.empty_like(y, dtype=S.dtype)
    if fn is None:
        return s_new, x, mix.new_empty(0), mix.new_empty(0)
    return s_new, x, mix.new_empty(S.shape[0]), mix.new_empty(S.shape[0], fn.shape[0])


@torch.library.custom_op("cedar::mhc_step_bwd", mutates_args=())
def _bwd_op(y: torch.Tensor, S: torch.Tensor, mix: torch.Tensor, fn: torch.Tensor | None, s_new: torch.Tensor,
            g_snew: torch.Tensor, g_x: torch.Tensor, g_sumsq: torch.Tensor | None, g_raw: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g_y, g_s, g_mix, g_fn = mhc_step_bwd(y, S, mix, fn, s_new, g_snew, g_x, g_sumsq, g_raw)
    return g_y, g_s, g_mix, mix.new_empty(0) if g_fn is None else g_fn


@_bwd_op.register_fake
def _(y, S, mix, fn, s_new, g_snew, g_x, g_sumsq, g_raw):
    return (torch.empty_like(y), torch.empty_like(S), torch.empty_like(mix),
            mix.new_empty(0) if fn is None else torch.empty_like(fn))


class _MHCStep(torch.autograd.Function):
    """(y, S, mix, fn) -> (S', x, sum_sq, raw) with the fused kernels in both directions (the operators above;
    tile keywords, which only the bench and the tests give, call the host wrapper directly)."""

    @staticmethod
    def forward(ctx, y, S, mix, fn, fwd_kwargs):
        if fwd_kwargs:
            s_new, x, sumsq, raw = mhc_step_fwd(y, S, mix, fn, **fwd_kwargs)
        else:
            s_new, x, sumsq, raw = _fwd_op(y, S, mix, fn)
            if fn is None:
                sumsq = raw = None
        ctx.save_for_backward(y, S, mix, fn, s_new)
        return s_new, x, sumsq, raw

    @staticmethod
    def backward(ctx, g_snew, g_x, g_sumsq, g_raw):
        y, S, mix, fn, s_new = ctx.saved_tensors
        if fn is not None:
            g_sumsq = torch.zeros(S.shape[0], device=S.device) if g_sumsq is None else g_sumsq
            g_raw = torch.zeros(S.shape[0], fn.shape[0], device=S.device) if g_raw is None else g_raw
        g_y, g_s, g_mix, g_fn = _bwd_op(y, S, mix, fn, s_new, g_snew, g_x, g_sumsq, g_raw)
        return g_y, g_s, g_mix, None if fn is None else g_fn, None


def mhc_step(y: torch.Tensor, S: torch.Tensor, mix: torch.Tensor, fn: torch.Tensor | None = None, **fwd_kwargs):
    """Autograd-aware fused step on flat tensors: y [N, D], S [N, n, D], mix [N, n+1, n+1] fp32, fn [M, n*D]
    -> (S' [N, n, D], x [N, D], sum_sq [N] or None, raw [N, M] or None). Gradients reach y, S, mix and fn."""
    return _MHCStep.apply(y.contiguous(), S.contiguous(), mix.contiguous(), fn, fwd_kwargs)
