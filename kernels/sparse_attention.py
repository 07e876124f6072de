"""Sparse shared-KV (MQA) attention with a per-head sink: Triton forward/backward and the gather-based reference.

Shape legend: B batch, T tokens (queries = window keys), H query heads, D latent/head width, E compressed entries,
K top-k slots per query, W window.

What one query at position t computes (REFERENCE A2, `model.attention.attend`):
    keys    = [kv_win[t-W+1 .. t] (those >= 0) ; kv_cmp[topk_idx[t, k]] for the slots k with idx >= 0]
    logits  = q[t, h] . key * D^-1/2, in fp32
    p       = exp(logit - m) / (sum exp(logit - m) + exp(sink_h - m)),  m = max(logits, sink_h)
    out     = sum p * key                      (K = V: one latent serves as key and value for all heads)
The sink joins the max and the denominator only, so a row with no visible key gives out = 0 and stays finite.

Kernel layout (FlashMLA-style, in Triton): one program per query token holds all H heads as the M dimension of its
tensor-core tiles, so every key row it loads serves all heads at once (MQA: with H=64 a [64, D] x [D, N] tile).
The window keys are a contiguous slice of kv_win; the compressed keys are gathered row by row through topk_idx.

Forward (`_sparse_attn_fwd`): online softmax in the log2 domain, the running max starting at the sink (finite, so
no -inf - -inf NaN); saves lse for the backward. Triton puts all warps of a chained dot (QK^T feeding PV) on the M
axis, and M = 64 heads is one warpgroup's worth, so with the 8 warps that the [64, 512] fp32 accumulator needs,
QK^T is computed by both warpgroups: a 2/3 ceiling on tensor-core efficiency that a hand-written warp-specialised
kernel (FlashMLA) avoids. Variants (FWD_CONFIG, plain keys only): SPLIT_D splits the output channels over programs
(acc [64, D / SPLIT_D], the logits recomputed by each); PIPE computes the logits one key block ahead, carried through
the loop, which is not a chain for Triton's layout choice: QK^T splits its key columns across the warpgroups (no
duplicate; checked in the sm_90 TTGIR) and its wgmma can overlap the previous block's softmax, for a second load of
each key block. Two query tokens per program (M = 128) would give each warpgroup its own rows, but their [128, 512]
fp32 accumulator is the whole register file, so it needs SPLIT_D = 2, which duplicates QK^T again across programs,
and the top-k keys (80% of the work) differ per token; not pursued. In the sm_90 TTGIR no variant's key tiles become
async copies (only the top-k index loads are pipelined): each key load's latency is exposed once per block.

Backward, three launches per chunk of queries, none with a chained dot (so no duplicated tiles):
- `_bwd_probs`: P = exp2(logits - lse) and dS * scale = P * (dO.V - rowsum(dO * O)) * scale for every (head, slot),
  written to a scratch buffer in the input dtype (the dS the tensor cores see is rounded to it anyway, as in
  FlashAttention); also the sink's gradient per row;
- `_bwd_dq`: dq = sum over slots of dS * key, a GEMM over the gathered keys;
- `_bwd_dkv`: per block of slots, dS^T q + P^T dO (K = V: key and value gradient share the row), scatter-added into
  fp32 key gradients with atomics. A per-query key set has no owner program without an inverse index (the choice
  public sparse-MLA backward kernels make too); the summation order, and so the last bits of dkv, vary run to run.
  Measured on the H200 this launch is bound by writing an fp32 [BN, D] block per query and slot block (a reduction
  over only 64 heads stands behind each), not by the atomics: plain stores are 6% faster.
Variants (BWD_CONFIG): window_dkv="keys" gives the window keys' gradient to `_bwd_dkv_window`, key-centric (key j
receives from queries j .. j + W - 1: summed in registers, one plain read-add-store per key and chunk,
deterministic) and leaves only the top-k slots to the atomic launch; dkv_unchained makes the atomic launch one
K = 2H dot per channel half ([dS | P]^T [q; dO]) instead of two chained dots, whose first gets all warps on M and so
is computed by both warpgroups at BN = 64.
Slots: [0, NW) are the window keys j = t - W + 1 + n and [NW, NW + K) the top-k entries, NW = W rounded up to the
key block; the backward stacks kv_win and kv_cmp into one [B*T + B*E, D] tensor so one loop walks both.

Quantised inference-cache inputs (SPEC 1.4), forward only: kv_win may be FP8 `(values float8_e4m3fn [B, T, D],
scales float8_e8m0fnu [B, T, D/32])` as `kernels.fp8.quantize_fp8(x, block=32)` writes it, and kv_cmp FP4 E2M1
`(codes uint8 [B, E, D/2], scales float8_e4m3fn [B, E, D/16])` as `kernels.fp4.quantize(x, 16, "e4m3")` writes it.
`_load_keys` decodes each key tile in registers right after loading its bytes, to q's dtype; no dequantised copy
is written. The decode is exact: a code times its block scale has at most 6 significant bits and is 0 or at least
2^-31 in magnitude (smallest E4M3 subnormal times the smallest E8M0 scale quantize_fp8 writes), so fp32 and bf16
hold it and the tile equals `dequantize(...).to(q.dtype)` (fp16 q: values under 2^-24 round alike on both paths).
Codes go through fp16 bit patterns: an E4M3 byte shifted up 7 bits, or an E2M1 nibble 9, is an fp16 worth the code
over 2^8 (E4M3) or 2^14 (E2M1), and fp16 -> fp32 conversion is exact for subnormal codes too (nothing depends on
whether fp32 subnormals are flushed). The leftover power of two is folded into the FP4 block scale and is one more
multiply for FP8. Bytes the quantisers never write for finite input (E4M3 NaN, E8M0 0 and 255) are out of contract.
A gradient through a quantised input raises (`sparse_attention` when a quantised tensor requires grad, the
backward when it is reached).

Caller contract: topk_idx holds distinct entries per query (duplicates would be counted twice, unlike the one-hot
mask of `attend`); -1 marks an empty slot; any index outside [0, E) is treated as empty (the kernel never reads out
of bounds), whereas the reference raises on it.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kernels import fp4, fp8
from kernels.sparse_attention_ref import sparse_attention_reference, topk_to_mask  # noqa: F401 (re-exported)

__all__ = ["sparse_attention", "sparse_attention_reference", "topk_to_mask"]

_IMPLS = ("reference", "triton")
_LOG2E = math.log2(math.e)

FP8_BLOCK = 32
"""channels per float8_e8m0fnu scale of the FP8 window KV (SPEC 1.4; `kernels.fp8.quantize_fp8(x, block=32)`)"""
FP4_BLOCK = 16
"""channels per float8_e4m3fn scale of the FP4 compressed KV (SPEC 1.4; `kernels.fp4.quantize(x, 16, "e4m3")`)"""
# Key formats, the FMT constexpr of `_load_keys`: a plain tensor in q's dtype, FP8 window KV, FP4 compressed KV.
_PLAIN, _FP8, _FP4 = 0, 1, 2
# Per quantised argument: (format name, values dtype, channels per values element, scales dtype, block, FMT).
_QUANT_FORMATS = {
    "kv_win": ("FP8", torch.float8_e4m3fn, 1, torch.float8_e8m0fnu, FP8_BLOCK, _FP8),
    "kv_cmp": ("FP4", torch.uint8, 2, torch.float8_e4m3fn, FP4_BLOCK, _FP4),
}

# Launch parameters, measured for H=64, D=512 on an H200 (bench/kernel_cases/sparse_attention.py): the [64, 512]
# fp32 accumulator is 128 registers a thread at 8 warps, and q (and dO) take 64 KB of shared memory each, so key
# blocks stay at 64 rows. Per kernel (num_warps, num_stages); BLOCK_N is shared by the three backward kernels (it
# sets the scratch layout); the scratch for P and dS is bounded by processing the queries in chunks. The variants
# (module docstring): FWD_CONFIG SPLIT_D (1 or 2) and PIPE; BWD_CONFIG dkv_unchained, window_dkv ("atomic" or
# "keys") with the key-centric launch's BLOCK_J (>= 64 for wgmma), channel slices and (num_warps, num_stages).
# Defaults are the measured ones until the sweep (bench/kernel_cases/sparse_attention.py, sweep=True) says otherwise.
# H200 sweep 2026-11-30 (BENCHMARKS.md): no forward variant beat the default loop (PIPE 15.8 ms, SPLIT_D 18.6+ ms
# against 11.5 ms); the unchained key-gradient launch took the backward from 43.0 to 38.2 ms, the key-centric window
# launch made it slower (44.3 ms), so both variants stay selectable but only dkv_unchained is on.
FWD_CONFIG = {"BLOCK_N": 64, "fwd": (8, 2), "SPLIT_D": 1, "PIPE": False}
# Quantised KV with 16-bit queries runs on fp32 operands (see `sparse_attention`): [64, 512] fp32 queries take
# 128 KB of shared memory, so the key tiles shrink to fit the H200's 227 KB (32-row tiles asked for 256 KB).
QUANT_FWD_CONFIG = {"BLOCK_N": 16, "fwd": (8, 1)}
# How the Triton path reads quantised KV. "separate": one dequantisation pass (the Triton kernels of kernels/fp4_triton,
# bit-exact on the H200) into q's dtype, then the plain kernel; "on_load": the kernel decodes each key tile in
# registers right after loading its bytes. On the H200 (Triton 3.6) the first on-load decode (a reshape for the
# block scales, an interleave for the FP4 nibbles) fed the tensor cores wrong values, with 16-bit queries and with
# fp32 queries on TF32 alike (fp32 "ieee" dots were right, at 0.6 TFLOP/s). The decode is now elementwise in the
# tile's own layout and exact in the CPU interpreter, but has not run on a GPU, so "separate" is the default there.
QUANT_DECODE = "separate"
# With QUANT_DECODE = "on_load": True runs 16-bit queries as fp32 on TF32 dots (QUANT_FWD_CONFIG; every product is
# still exact), False keeps them 16-bit (FWD_CONFIG).
QUANT_FP32_QUERIES = False
BWD_CONFIG = {"BLOCK_N": 64, "probs": (8, 1), "dq": (8, 2), "dkv": (8, 2), "scratch_bytes": 1 << 30,
              "dkv_unchained": True, "window_dkv": "atomic", "dkv_window": (8, 2), "BLOCK_J": 64,
              "dkv_window_SPLIT_D": 2}


# ------------------------------------------------------------------------------------------------------------------
# Triton kernels
# ------------------------------------------------------------------------------------------------------------------
@triton.jit
def _rows_mask(rows_ok, cols, D: tl.constexpr, FULL: tl.constexpr):
    """[R] row mask, [C] channel offsets -> [R, C] mask. When D fills the tile (FULL) the channel test is a
    compile-time constant, which keeps the loads 16-byte vectorised (and eligible for async copies)."""
    if FULL:
        return rows_ok[:, None] & tl.full([1, cols.shape[0]], 1, tl.int1)
    else:
        return rows_ok[:, None] & (cols < D)[None, :]


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr):
    """tl.dot with the accumulator `acc` (or None). The CPU interpreter multiplies 16-bit operands wrongly, so under
    it (PREC == "interp") the operands go in as fp32; on the GPU they stay 16-bit for the tensor cores."""
    if PREC == "interp":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _e4m3_over_2p8(bits):
    """float8_e4m3fn bytes (int32) -> fp32 value / 2^8: the 7 magnitude bits moved up by 7 fill an fp16's exponent
    (bias 15 instead of 7) and its top mantissa bits, subnormals included."""
    h = ((bits & 0x80) << 8) | ((bits & 0x7F) << 7)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_over_2p14(nib):
    """4-bit E2M1 codes (int32: sign bit 3, 2 exponent bits, 1 mantissa bit) -> fp32 value / 2^14, through an fp16
    (bias 15 instead of 1); magnitude codes 0..7 give {0, .5, 1, 1.5, 2, 3, 4, 6} / 2^14."""
    h = ((nib & 8) << 12) | ((nib & 7) << 9)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _load_keys(kv_ptr, scale_ptr, rows, valid, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
               FMT: tl.constexpr):
    """Key rows [BN] (valid [BN]) of a [rows, D] key tensor -> [BN, BD] tile, 0 in invalid rows and padded channels.
    FMT 0: plain keys, returned in their dtype. FMT 1 (FP8): e4m3 bytes [rows, D] and e8m0 scale bytes
    [rows, D / 32]. FMT 2 (FP4): packed E2M1 codes [rows, D / 2] (channel 2i in the low nibble) and e4m3 scale bytes
    [rows, D / 16]. Quantised tiles come back as fp32 holding the exact dequantised values (see the module docstring),
    decoded in registers from the bytes just loaded."""
    FULL: tl.constexpr = D == BLOCK_D
    if FMT == 0:
        offs_d = tl.arange(0, BLOCK_D)
        return tl.load(kv_ptr + rows[:, None] * D + offs_d[None, :], mask=_rows_mask(valid, offs_d, D, FULL),
                       other=0.0)
    elif FMT == 1:
        # Every channel's scale byte is loaded beside it (the 32 channels of a block read the same byte), so the
        # decode stays elementwise in the tile's own layout: a reshape or interleave here fed the tensor cores wrong
        # values on the H200 (Triton 3.6).
        offs_d = tl.arange(0, BLOCK_D)
        mask = _rows_mask(valid, offs_d, D, FULL)
        bits = tl.load(kv_ptr + rows[:, None] * D + offs_d[None, :], mask=mask, other=0).to(tl.int32)
        code = tl.load(scale_ptr + rows[:, None] * (D // 32) + (offs_d // 32)[None, :], mask=mask,
                       other=0).to(tl.int32)
        # e8m0 code c is 2^(c - 127), the fp32 exponent field c. The decode's missing 2^8 is a separate multiply:
        # folded into the scale it would overflow for c > 246, which quantize_fp8 writes for fp32 amax near 2^127.
        scale = (code << 23).to(tl.float32, bitcast=True)
        return _e4m3_over_2p8(bits) * 256.0 * scale
    else:
        # channel d: the low (even d) or high (odd d) nibble of byte d // 2, and scale byte d // 16
        offs_d = tl.arange(0, BLOCK_D)
        mask = _rows_mask(valid, offs_d, D, FULL)
        byte = tl.load(kv_ptr + rows[:, None] * (D // 2) + (offs_d // 2)[None, :], mask=mask, other=0).to(tl.int32)
        nib = (byte >> ((offs_d % 2) * 4)[None, :]) & 0xF
        code = tl.load(scale_ptr + rows[:, None] * (D // 16) + (offs_d // 16)[None, :], mask=mask,
                       other=0).to(tl.int32)
        scale = _e4m3_over_2p8(code) * 4194304.0  # e4m3 scale, times the 2^14 the E2M1 decode leaves out: 2^(8 + 14)
        return _e2m1_over_2p14(nib) * scale


@triton.jit
def _slot_rows(idx_ptr, row, b, t, B, T, E, K, window, NW, n0, offs_n):
    """Key slots n0 + offs_n of query t -> (rows [BN] of the stacked keys [kv_win (B*T rows); kv_cmp (B*E rows)],
    valid [BN]).

    Slots [0, NW) are the window keys j = t - W + 1 + n; slots [NW, NW + K) are the top-k entries. NW is W rounded
    up to BLOCK_N, so a block never mixes the two, and one pipelined loop walks both (the window alone is only
    W / BLOCK_N iterations, too short to pipeline on its own). One base pointer with integer rows keeps the loads
    analysable (a select between two pointers defeats Triton's async-copy pipelining)."""
    n = n0 + offs_n
    j = t - window + 1 + n
    k_slot = n - NW
    idx = tl.load(idx_ptr + row * K + k_slot, mask=(k_slot >= 0) & (k_slot < K), other=-1)
    is_win = n < NW
    valid = tl.where(is_win, (n < window) & (j >= 0), (idx >= 0) & (idx < E))
    rows = tl.where(is_win, b * T + j, B * T + b * E + idx)
    return rows, valid


@triton.jit
def _softmax_pv(s, valid, v, m, l, acc, PREC: tl.constexpr):
    """Logits s [BH, BN] (log2 units) of one key block, valid [BN], values v [BN, BC] -> updated (m, l, acc)."""
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))  # finite: m starts at the sink
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    # probabilities are cast to V's dtype before P @ V, as the reference does
    return m_new, l, _dot(p.to(v.dtype), v, acc * alpha[:, None], PREC)


@triton.jit
def _online_softmax_step(q, k, valid, m, l, acc, qk_scale, PREC: tl.constexpr):
    """One block of N keys for all heads: q [BH, BD], k [BN, BD], valid [BN] -> updated (m, l, acc), log2 domain."""
    s = _dot(q, tl.trans(k), None, PREC) * qk_scale  # [BH, BN]
    return _softmax_pv(s, valid, k, m, l, acc, PREC)


@triton.jit
def _key_cols(kv_ptr, rows, valid, col0, D: tl.constexpr, BLOCK_C: tl.constexpr, FULL: tl.constexpr):
    """Channels [col0, col0 + BC) of plain key rows [BN] (valid [BN]) -> [BN, BC], 0 in invalid rows / channels."""
    offs = col0 + tl.arange(0, BLOCK_C)
    return tl.load(kv_ptr + rows[:, None] * D + offs[None, :], mask=_rows_mask(valid, offs, D, FULL), other=0.0)


@triton.jit
def _part_rows(idx_ptr, row, b, t, T, E, K, start, offs_n, WIN: tl.constexpr):
    """Key block at `start` of one part of query t's keys -> (rows [BN] of kv_win (WIN) or kv_cmp, valid [BN])."""
    if WIN:
        j = start + offs_n  # window keys j in (t - window, t], a contiguous slice of kv_win
        return b * T + j, j <= t
    else:
        slot = start + offs_n  # selected compressed entries, gathered through the query's top-k row
        idx = tl.load(idx_ptr + row * K + slot, mask=slot < K, other=-1)
        return b * E + idx, (idx >= 0) & (idx < E)


@triton.jit
def _fwd_part(q, m, l, acc, kv_ptr, idx_ptr, row, b, t, T, E, K, lo, hi, col0, qk_scale,
              D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
              PREC: tl.constexpr, WIN: tl.constexpr, PIPE: tl.constexpr):
    """Key blocks [lo, hi) of one part (window or top-k) of a plain-key forward, the output channels [col0,
    col0 + BC) only (SPLIT_D > 1 recomputes the logits per channel slice).

    PIPE computes the logits one block ahead and carries them into the next iteration: Triton lays a dot whose
    result reaches another dot in the same iteration (QK^T -> PV) out with all warps on M, so with M = 64 heads and
    8 warps both warpgroups compute the whole QK^T; carried, QK^T is no longer chained and splits its key columns
    across the warpgroups, and its wgmma can run under the previous block's softmax. The price: the previous
    block's keys are loaded again (an L2 hit) as the PV operand."""
    FULL: tl.constexpr = D == BLOCK_D
    offs_n = tl.arange(0, BLOCK_N)
    if PIPE:
        rows, valid = _part_rows(idx_ptr, row, b, t, T, E, K, lo, offs_n, WIN)
        s = _dot(q, tl.trans(_key_cols(kv_ptr, rows, valid, 0, D, BLOCK_D, FULL)), None, PREC) * qk_scale
        # One step past the end (a masked block, no memory traffic) instead of a P @ V after the loop: that dot would
        # be chained to the next part's through the loop results, and laid out with all warps on M.
        # The previous block's rows are recomputed from the loop index, not carried: Triton pipelines (async copies)
        # only loads whose addresses derive from the induction variable.
        for start in range(lo + BLOCK_N, hi + BLOCK_N, BLOCK_N):
            rows_n, valid_n = _part_rows(idx_ptr, row, b, t, T, E, K, start, offs_n, WIN)
            s_n = _dot(q, tl.trans(_key_cols(kv_ptr, rows_n, valid_n, 0, D, BLOCK_D, FULL)), None, PREC) * qk_scale
            rows, valid = _part_rows(idx_ptr, row, b, t, T, E, K, start - BLOCK_N, offs_n, WIN)
            v = _key_cols(kv_ptr, rows, valid, col0, D, BLOCK_C, FULL)
            m, l, acc = _softmax_pv(s, valid, v, m, l, acc, PREC)
            s = s_n
    else:
        for start in range(lo, hi, BLOCK_N):
            rows, valid = _part_rows(idx_ptr, row, b, t, T, E, K, start, offs_n, WIN)
            k = _key_cols(kv_ptr, rows, valid, 0, D, BLOCK_D, FULL)
            s = _dot(q, tl.trans(k), None, PREC) * qk_scale
            if BLOCK_C == BLOCK_D:
                m, l, acc = _softmax_pv(s, valid, k, m, l, acc, PREC)
            else:
                v = _key_cols(kv_ptr, rows, valid, col0, D, BLOCK_C, FULL)
                m, l, acc = _softmax_pv(s, valid, v, m, l, acc, PREC)
    return m, l, acc


@triton.jit
def _sparse_attn_fwd(
    q_ptr, kvw_ptr, kvw_scale_ptr, kvc_ptr, kvc_scale_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr, probs_ptr,
    T, E, K, window, qk_scale,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr, TOPK_PROBS: tl.constexpr, WIN_FMT: tl.constexpr, CMP_FMT: tl.constexpr,
    SPLIT_D: tl.constexpr, PIPE: tl.constexpr,
):
    """One query token, all heads, output channels [pid2 * BD / SPLIT_D, ...). WIN_FMT / CMP_FMT: the key formats
    of kv_win / kv_cmp (`_load_keys`); a quantised tile is decoded to q's dtype, so the dots and the P @ V cast see
    what a dequantised input gives. SPLIT_D > 1 and PIPE (`_fwd_part`) take plain keys only."""
    FULL: tl.constexpr = D == BLOCK_D
    BLOCK_C: tl.constexpr = BLOCK_D // SPLIT_D
    t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pid_d = tl.program_id(2)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = pid_d * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < H
    hd_ok = _rows_mask(h_ok, offs_d, D, FULL)
    row = b * T + t  # this query's row in [B*T, ...]
    hd_offs = row * H * D + offs_h[:, None] * D + offs_d[None, :]

    q = tl.load(q_ptr + hd_offs, mask=hd_ok, other=0.0)  # [BH, BD]
    m = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0) * 1.4426950408889634  # sink in log2 units
    l = tl.full([BLOCK_H], 1.0, tl.float32)  # exp2(sink - m) with m = sink
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)

    # Two loops, window then top-k. (Measured on the H200: 12% faster than one loop over both kinds of slot, as
    # the backward kernels walk them; each loop keeps a single base pointer.)
    if SPLIT_D == 1 and not PIPE:
        for start in range(tl.maximum(t - window + 1, 0), t + 1, BLOCK_N):
            j = start + offs_n  # window keys j in (t - window, t], a contiguous slice of kv_win
            valid = j <= t
            k = _load_keys(kvw_ptr, kvw_scale_ptr, b * T + j, valid, D, BLOCK_D, BLOCK_N, WIN_FMT).to(q.dtype)
            m, l, acc = _online_softmax_step(q, k, valid, m, l, acc, qk_scale, PREC)
        for k0 in range(0, K, BLOCK_N):
            slot = k0 + offs_n  # selected compressed entries, gathered through the query's top-k row
            idx = tl.load(idx_ptr + row * K + slot, mask=slot < K, other=-1)
            valid = (idx >= 0) & (idx < E)
            k = _load_keys(kvc_ptr, kvc_scale_ptr, b * E + idx, valid, D, BLOCK_D, BLOCK_N, CMP_FMT).to(q.dtype)
            m, l, acc = _online_softmax_step(q, k, valid, m, l, acc, qk_scale, PREC)
    else:
        m, l, acc = _fwd_part(q, m, l, acc, kvw_ptr, idx_ptr, row, b, t, T, E, K, tl.maximum(t - window + 1, 0),
                              t + 1, pid_d * BLOCK_C, qk_scale, D, BLOCK_D, BLOCK_C, BLOCK_N, PREC, True, PIPE)
        if K > 0:
            m, l, acc = _fwd_part(q, m, l, acc, kvc_ptr, idx_ptr, row, b, t, T, E, K, 0, K, pid_d * BLOCK_C,
                                  qk_scale, D, BLOCK_D, BLOCK_C, BLOCK_N, PREC, False, PIPE)

    out = acc / l[:, None]
    lse = m + tl.log2(l)  # the same in every channel slice (same logits, same order)
    tl.store(out_ptr + row * H * D + offs_h[:, None] * D + offs_c[None, :], out.to(out_ptr.dtype.element_ty),
             mask=_rows_mask(h_ok, offs_c, D, FULL))
    tl.store(lse_ptr + row * H + offs_h, lse, mask=offs_h < tl.where(pid_d == 0, H, 0))  # once
    if TOPK_PROBS:
        # The indexer's KL target: each top-k slot's final probability summed over heads. Needs the final lse, so
        # it is a second pass over the selected keys (QK^T only, +40% of the forward's FLOPs when asked for); the
        # first channel slice does it.
        for k0 in range(0, tl.where(pid_d == 0, K, 0), BLOCK_N):
            slot = k0 + offs_n
            idx = tl.load(idx_ptr + row * K + slot, mask=slot < K, other=-1)
            valid = (idx >= 0) & (idx < E)
            k = _load_keys(kvc_ptr, kvc_scale_ptr, b * E + idx, valid, D, BLOCK_D, BLOCK_N, CMP_FMT).to(q.dtype)
            s = _dot(q, tl.trans(k), None, PREC) * qk_scale
            p = tl.where(h_ok[:, None] & valid[None, :], tl.exp2(s - lse[:, None]), 0.0)
            tl.store(probs_ptr + row * K + slot, tl.sum(p, 0), mask=slot < K)


# Backward: see the module docstring for the three launches and why they are split.
@triton.jit
def _probs_block(q, do, k, valid, lse, delta, scale, qk_scale, p_ptrs, ds_ptrs, store_ok, PREC: tl.constexpr):
    s = _dot(q, tl.trans(k), None, PREC) * qk_scale  # [BH, BN]
    p = tl.where(valid[None, :], tl.exp2(s - lse[:, None]), 0.0)
    dp = _dot(do, tl.trans(k), None, PREC)  # dO . V with V = K
    ds = p * (dp - delta[:, None]) * scale
    tl.store(p_ptrs, p.to(p_ptrs.dtype.element_ty), mask=store_ok)
    tl.store(ds_ptrs, ds.to(ds_ptrs.dtype.element_ty), mask=store_ok)


@triton.jit
def _bwd_probs(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, dout_ptr, lse_ptr, p_ptr, ds_ptr, dsink_ptr,
    B, T, E, K, window, NW, t0, scale, qk_scale,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
):
    """Per query: P = exp(logits - lse) and dS * scale = P * (dO.V - rowsum(dO * O)) * scale for every slot."""
    FULL: tl.constexpr = D == BLOCK_D
    t = t0 + tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < H
    hd_ok = _rows_mask(h_ok, offs_d, D, FULL)
    row = b * T + t
    hd_offs = row * H * D + offs_h[:, None] * D + offs_d[None, :]
    q = tl.load(q_ptr + hd_offs, mask=hd_ok, other=0.0)
    do = tl.load(dout_ptr + hd_offs, mask=hd_ok, other=0.0)
    o = tl.load(out_ptr + hd_offs, mask=hd_ok, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # [BH] rowsum(dO * O)
    # padded heads get lse = +inf so their p is exactly 0
    lse = tl.load(lse_ptr + row * H + offs_h, mask=h_ok, other=float("inf"))
    # d loss / d sink_h = -p_sink * rowsum(dO * O); summed over (b, t) on the host (no hot atomics on H addresses)
    sink = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0) * 1.4426950408889634
    tl.store(dsink_ptr + row * H + offs_h, -tl.exp2(sink - lse) * delta, mask=h_ok)

    NS = NW + K
    srow = (t - t0 + b * tl.num_programs(0)) * H  # this query's first row in the chunk's scratch [B*chunk*H, NS]
    n_lo = (tl.maximum(window - 1 - t, 0) // BLOCK_N) * BLOCK_N  # slots before token 0 stay unwritten (and unread)
    for n0 in range(n_lo, NS, BLOCK_N):
        rows, valid = _slot_rows(idx_ptr, row, b, t, B, T, E, K, window, NW, n0, offs_n)
        k = tl.load(kv_ptr + rows[:, None] * D + offs_d[None, :], mask=_rows_mask(valid, offs_d, D, FULL), other=0.0)
        s_offs = (srow + offs_h)[:, None] * NS + (n0 + offs_n)[None, :]
        _probs_block(q, do, k, valid, lse, delta, scale, qk_scale, p_ptr + s_offs, ds_ptr + s_offs,
                     h_ok[:, None] & (n0 + offs_n < NS)[None, :], PREC)


@triton.jit
def _bwd_dq(
    kv_ptr, idx_ptr, ds_ptr, dq_ptr,
    B, T, E, K, window, NW, t0,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
):
    """Per query: dq = sum over slots of (dS * scale) @ key."""
    FULL: tl.constexpr = D == BLOCK_D
    t = t0 + tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < H
    row = b * T + t
    NS = NW + K
    srow = (t - t0 + b * tl.num_programs(0)) * H
    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    n_lo = (tl.maximum(window - 1 - t, 0) // BLOCK_N) * BLOCK_N
    for n0 in range(n_lo, NS, BLOCK_N):
        rows, valid = _slot_rows(idx_ptr, row, b, t, B, T, E, K, window, NW, n0, offs_n)
        k = tl.load(kv_ptr + rows[:, None] * D + offs_d[None, :], mask=_rows_mask(valid, offs_d, D, FULL), other=0.0)
        ds = tl.load(ds_ptr + (srow + offs_h)[:, None] * NS + (n0 + offs_n)[None, :],
                     mask=h_ok[:, None] & (n0 + offs_n < NS)[None, :], other=0.0)
        dq = _dot(ds, k, dq, PREC)
    tl.store(dq_ptr + row * H * D + offs_h[:, None] * D + offs_d[None, :], dq.to(dq_ptr.dtype.element_ty),
             mask=_rows_mask(h_ok, offs_d, D, FULL))


@triton.jit
def _dkv_half(ds, p, q_c, do_c, dkv_ptrs, mask, PREC: tl.constexpr):
    dkv = _dot(tl.trans(ds), q_c, None, PREC)
    dkv = _dot(tl.trans(p), do_c, dkv, PREC)
    tl.atomic_add(dkv_ptrs, dkv, mask=mask, sem="relaxed")


@triton.jit
def _bwd_dkv(
    q_ptr, dout_ptr, idx_ptr, p_ptr, ds_ptr, dkv_ptr,
    B, T, E, K, window, NW, t0, slot_lo,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr, UNCHAINED: tl.constexpr,
):
    """Per query and slot block from slot_lo on: dkv[key] += (dS * scale)^T q + P^T dO, added atomically into fp32
    rows (slot_lo = NW: the top-k slots only, the window's going to `_bwd_dkv_window`).
    K = V, so the key gradient and the value gradient land on the same row. The columns go in two halves: a
    [BN, D] fp32 tile (and the layout change before its atomics) would not fit on chip."""
    FULL: tl.constexpr = D == BLOCK_D
    HALF: tl.constexpr = BLOCK_D // 2
    t = t0 + tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, HALF)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < H
    row = b * T + t
    NS = NW + K
    srow = (t - t0 + b * tl.num_programs(0)) * H
    n_lo = tl.maximum((tl.maximum(window - 1 - t, 0) // BLOCK_N) * BLOCK_N, slot_lo)
    if UNCHAINED:
        # One dot with K = 2H per half: [dS | P]^T [q; dO], the rows paired through one pointer select (rows < BH:
        # dS with q; the rest: P with dO). Two dots into one accumulator would count as chained, and the first
        # would get all warps on M: with BN = 64 both warpgroups would compute it (TTGIR for sm_90).
        offs_r = tl.arange(0, 2 * BLOCK_H)
        first = offs_r < BLOCK_H
        h2 = tl.where(first, offs_r, offs_r - BLOCK_H)
        r_ok = h2 < H
        qd_base = tl.where(first, q_ptr, dout_ptr) + row * H * D + h2 * D  # [2BH] row pointers
        qd_lo = tl.load(qd_base[:, None] + offs_c[None, :], mask=_rows_mask(r_ok, offs_c, D, FULL), other=0.0)
        qd_hi = tl.load(qd_base[:, None] + (offs_c + HALF)[None, :], mask=_rows_mask(r_ok, offs_c + HALF, D, FULL),
                        other=0.0)
        pd_base = tl.where(first, ds_ptr, p_ptr) + (srow + h2) * NS  # [2BH]
        for n0 in range(n_lo, NS, BLOCK_N):
            rows, valid = _slot_rows(idx_ptr, row, b, t, B, T, E, K, window, NW, n0, offs_n)
            pd = tl.load(pd_base[:, None] + (n0 + offs_n)[None, :], mask=r_ok[:, None] & (n0 + offs_n < NS)[None, :],
                         other=0.0)  # [2BH, BN]
            lo = dkv_ptr + rows[:, None] * D + offs_c[None, :]
            tl.atomic_add(lo, _dot(tl.trans(pd), qd_lo, None, PREC), mask=_rows_mask(valid, offs_c, D, FULL),
                          sem="relaxed")
            tl.atomic_add(lo + HALF, _dot(tl.trans(pd), qd_hi, None, PREC),
                          mask=_rows_mask(valid, offs_c + HALF, D, FULL), sem="relaxed")
    else:
        lo_offs = row * H * D + offs_h[:, None] * D + offs_c[None, :]
        lo_ok = _rows_mask(h_ok, offs_c, D, FULL)
        hi_ok = _rows_mask(h_ok, offs_c + HALF, D, FULL)
        q_lo = tl.load(q_ptr + lo_offs, mask=lo_ok, other=0.0)
        q_hi = tl.load(q_ptr + lo_offs + HALF, mask=hi_ok, other=0.0)
        do_lo = tl.load(dout_ptr + lo_offs, mask=lo_ok, other=0.0)
        do_hi = tl.load(dout_ptr + lo_offs + HALF, mask=hi_ok, other=0.0)
        for n0 in range(n_lo, NS, BLOCK_N):
            rows, valid = _slot_rows(idx_ptr, row, b, t, B, T, E, K, window, NW, n0, offs_n)
            s_offs = (srow + offs_h)[:, None] * NS + (n0 + offs_n)[None, :]
            s_ok = h_ok[:, None] & (n0 + offs_n < NS)[None, :]
            ds = tl.load(ds_ptr + s_offs, mask=s_ok, other=0.0)
            p = tl.load(p_ptr + s_offs, mask=s_ok, other=0.0)
            lo = dkv_ptr + rows[:, None] * D + offs_c[None, :]
            _dkv_half(ds, p, q_lo, do_lo, lo, _rows_mask(valid, offs_c, D, FULL), PREC)
            _dkv_half(ds, p, q_hi, do_hi, lo + HALF, _rows_mask(valid, offs_c + HALF, D, FULL), PREC)



@triton.jit
def _bwd_dkv_window(
    q_ptr, dout_ptr, p_ptr, ds_ptr, dkv_ptr,
    T, window, NS, t0, nq, j_lo,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr,
    SPLIT_D: tl.constexpr, PREC: tl.constexpr,
):
    """Key-centric window gradient of the chunk's queries [t0, t0 + nq): for the window keys j0 .. j0 + BJ - 1
    (j0 = j_lo + pid0 * BJ) and the channels of slice pid1, dkv[j] += sum over the queries t in [j, j + W) of
    (dS * scale)[t, :, slot]^T q[t] + P[t, :, slot]^T dO[t], slot = j - t + W - 1. Each key row has one owner
    program per launch: the sum stays in registers and lands with one read-add-store (no atomics, deterministic);
    launches (chunks) are ordered by the stream. Each query step is a band of the [BJ, W] window: the dots cover
    (BJ + W - 1) * BJ (key, query) pairs for BJ * W useful ones."""
    FULL: tl.constexpr = D == BLOCK_D
    BLOCK_C: tl.constexpr = BLOCK_D // SPLIT_D
    j0 = j_lo + tl.program_id(0) * BLOCK_J
    b = tl.program_id(2).to(tl.int64)
    offs_j = j0 + tl.arange(0, BLOCK_J)
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    h_ok = offs_h < H
    hc_ok = _rows_mask(h_ok, offs_c, D, FULL)
    acc = tl.zeros([BLOCK_J, BLOCK_C], tl.float32)  # dS^T q
    acc_o = tl.zeros([BLOCK_J, BLOCK_C], tl.float32)  # P^T dO
    for t in range(tl.maximum(j0, t0), tl.minimum(j0 + BLOCK_J - 1 + window, t0 + nq)):
        n = offs_j - t + window - 1  # the keys' slots in query t's window; n < W <=> j <= t
        s_offs = ((t - t0 + b * nq) * H + offs_h)[:, None] * NS + n[None, :]
        s_ok = h_ok[:, None] & ((n >= 0) & (n < window))[None, :]
        ds = tl.load(ds_ptr + s_offs, mask=s_ok, other=0.0)  # [BH, BJ]
        p = tl.load(p_ptr + s_offs, mask=s_ok, other=0.0)
        hc_offs = ((b * T + t) * H + offs_h)[:, None] * D + offs_c[None, :]
        # two accumulators: a dot whose result is another dot's accumulator counts as chained, and gets the
        # all-warps-on-M layout (with BJ = 64, both warpgroups would compute it)
        acc = _dot(tl.trans(ds), tl.load(q_ptr + hc_offs, mask=hc_ok, other=0.0), acc, PREC)
        acc_o = _dot(tl.trans(p), tl.load(dout_ptr + hc_offs, mask=hc_ok, other=0.0), acc_o, PREC)
    ptrs = dkv_ptr + (b * T + offs_j)[:, None] * D + offs_c[None, :]
    ok = _rows_mask(offs_j < t0 + nq, offs_c, D, FULL)  # later keys are seen by later chunks only
    tl.store(ptrs, tl.load(ptrs, mask=ok, other=0.0) + (acc + acc_o), mask=ok)

# ------------------------------------------------------------------------------------------------------------------
# Host wrappers
# ------------------------------------------------------------------------------------------------------------------
def _check_kv(name: str, kv, B: int, rows: int | None, D: int, dtype: torch.dtype) -> int:
    """Validate kv_win ([B, T, D], rows = T) or kv_cmp ([B, E, D], rows = None: any E), either a plain tensor in q's
    dtype or its quantised (values, scales) pair (`_QUANT_FORMATS`); return its row count (T or E)."""
    if isinstance(kv, torch.Tensor):
        if kv.dim() != 3 or kv.shape[0] != B or kv.shape[2] != D or (rows is not None and kv.shape[1] != rows):
            want = f"[B, T, D] = {(B, rows, D)}" if rows is not None else f"[B, E, D] with B={B}, D={D}"
            raise ValueError(f"sparse_attention: {name} must be {want}, got {tuple(kv.shape)}")
        if kv.dtype != dtype:
            raise TypeError(f"sparse_attention: {name} must have q's dtype {dtype}, got {kv.dtype}")
        return kv.shape[1]
    fmt, values_dtype, per_value, scales_dtype, block, _ = _QUANT_FORMATS[name]
    pair = f"an {fmt} (values {values_dtype}, scales {scales_dtype}) tuple"
    if not (isinstance(kv, tuple) and len(kv) == 2 and all(isinstance(t, torch.Tensor) for t in kv)):
        raise TypeError(f"sparse_attention: {name} must be a tensor or {pair}, got {type(kv).__name__}")
    values, scales = kv
    if values.dtype != values_dtype or scales.dtype != scales_dtype:
        raise TypeError(f"sparse_attention: quantised {name} must be {pair}, got ({values.dtype}, {scales.dtype})")
    if D % block != 0:
        raise ValueError(f"sparse_attention: {fmt} {name} needs D divisible by its scale block {block}, got D={D}")
    n = rows if rows is not None else (values.shape[1] if values.dim() == 3 else "E")
    want_values, want_scales = (B, n, D // per_value), (B, n, D // block)
    if tuple(values.shape) != want_values or tuple(scales.shape) != want_scales:
        raise ValueError(f"sparse_attention: {fmt} {name} must be values {want_values} and scales {want_scales}, "
                         f"got {tuple(values.shape)} and {tuple(scales.shape)}")
    return n


def _kv_tensors(name: str, kv) -> dict[str, torch.Tensor]:
    """The tensors behind a kv argument, named for error messages ({} for None)."""
    if kv is None:
        return {}
    if isinstance(kv, torch.Tensor):
        return {name: kv}
    return {f"{name} values": kv[0], f"{name} scales": kv[1]}


def _check_inputs(q, kv_win, kv_cmp, topk_idx, sink, window) -> tuple[int, int, int, int, int, int]:
    """Validate shapes, dtypes and devices; return (B, T, H, D, E, K)."""
    name = "sparse_attention"
    if q.dim() != 4:
        raise ValueError(f"{name}: q must be [B, T, H, D], got shape {tuple(q.shape)}")
    B, T, H, D = q.shape
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name}: q must be bf16/fp16/fp32, got {q.dtype}")
    _check_kv("kv_win", kv_win, B, T, D, q.dtype)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{name}: window must be a positive int, got {window!r}")
    if tuple(sink.shape) != (H,) or sink.dtype != torch.float32:
        raise ValueError(f"{name}: sink must be fp32 [H] = [{H}], got {sink.dtype} {tuple(sink.shape)}")
    E = K = 0
    tensors = {"q": q, "sink": sink, **_kv_tensors("kv_win", kv_win), **_kv_tensors("kv_cmp", kv_cmp)}
    if kv_cmp is not None:
        E = _check_kv("kv_cmp", kv_cmp, B, None, D, q.dtype)
        if topk_idx is None or topk_idx.dim() != 3 or tuple(topk_idx.shape[:2]) != (B, T):
            got = None if topk_idx is None else tuple(topk_idx.shape)
            raise ValueError(f"{name}: topk_idx must be [B, T, K] = [{B}, {T}, K], got {got}")
        if topk_idx.dtype != torch.int32:
            raise TypeError(f"{name}: topk_idx must be int32 (-1 = empty slot), got {topk_idx.dtype}")
        K = topk_idx.shape[2]
        tensors["topk_idx"] = topk_idx
    for n, t in tensors.items():
        if t.device != q.device:
            raise ValueError(f"{name}: {n} is on {t.device}, q on {q.device}")
    return B, T, H, D, E, K


def _check_triton(tensors: dict[str, torch.Tensor]) -> None:
    for n, t in tensors.items():
        if t is None:
            continue
        if not t.is_contiguous():
            raise ValueError(f"sparse_attention(impl='triton'): {n} must be contiguous (call .contiguous())")
        if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError(f"sparse_attention(impl='triton'): {n} is on {t.device}; the Triton kernel needs "
                               "CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter)")


def _prec(dtype: torch.dtype) -> str:
    """The dots' PREC constexpr: exact fp32 dots for fp32 inputs, fp32 operands for 16-bit inputs under the CPU
    interpreter (see `_dot`), else the 16-bit tensor-core path (which ignores the setting)."""
    if dtype == torch.float32:
        return "ieee"
    return "interp" if os.environ.get("TRITON_INTERPRET", "0") == "1" else "tf32"


def _tiles(H: int, D: int) -> tuple[int, int]:
    # tensor-core tiles need every dim >= 16; padded heads/channels are masked to zero
    return max(16, triton.next_power_of_2(H)), max(16, triton.next_power_of_2(D))


def _stack_keys(q, kv_win, kv_cmp, topk_idx, window: int, block_n: int):
    """Stack the keys as [kv_win (B*T rows); kv_cmp (B*E rows)] (a copy 1/H the size of q) and return
    (keys, idx, E, K, NW): K = 0 when nothing is selected (the kernels then never read idx), NW = W rounded up to
    BLOCK_N."""
    B, T, D = kv_win.shape
    has_cmp = kv_cmp is not None and kv_cmp.shape[1] > 0 and topk_idx.shape[2] > 0
    E = kv_cmp.shape[1] if kv_cmp is not None else 0
    if has_cmp:
        keys, idx, K = torch.cat((kv_win.reshape(B * T, D), kv_cmp.reshape(B * E, D))), topk_idx, topk_idx.shape[2]
    else:
        keys, idx, K = kv_win, torch.empty(1, device=q.device, dtype=torch.int32), 0
    return keys, idx, E, K, triton.cdiv(window, block_n) * block_n


def _launch(cfg: dict, name: str) -> dict:
    warps, stages = cfg[name]
    return {"num_warps": warps, "num_stages": stages}


def _kernel_args(kv) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A validated kv argument -> (keys, scales, FMT) for `_load_keys`: fp8 bytes are passed as uint8 (decoded from
    their bits); a plain tensor stands in for its own absent scales."""
    if isinstance(kv, torch.Tensor):
        return kv, kv, _PLAIN
    values, scales = kv
    fmt = _FP4 if values.dtype == torch.uint8 else _FP8
    return values.view(torch.uint8), scales.view(torch.uint8), fmt


def _forward_triton(q, kv_win, kv_cmp, topk_idx, sink, window, topk_probs: bool = False, prec: str | None = None):
    """prec: the dots' PREC, default `_prec(q.dtype)`; "tf32" for fp32 queries that hold 16-bit values."""
    B, T, H, D, E, K = _check_inputs(q, kv_win, kv_cmp, topk_idx, sink, window)
    _check_triton({"q": q, **_kv_tensors("kv_win", kv_win), **_kv_tensors("kv_cmp", kv_cmp), "topk_idx": topk_idx,
                   "sink": sink})
    cfg = QUANT_FWD_CONFIG if prec == "tf32" else FWD_CONFIG
    BLOCK_H, BLOCK_D = _tiles(H, D)
    has_cmp = kv_cmp is not None and E > 0 and K > 0
    E, K = (E, K) if has_cmp else (0, 0)
    win, win_scales, win_fmt = _kernel_args(kv_win)
    # with K = 0 the top-k loop never runs: the window's tensors (and format) and an empty index stand in
    cmp, cmp_scales, cmp_fmt = _kernel_args(kv_cmp) if has_cmp else (win, win_scales, win_fmt)
    out = torch.empty_like(q)
    lse = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    probs = torch.empty(B, T, K, device=q.device, dtype=torch.float32) if topk_probs else lse
    placeholder_idx = torch.empty(1, device=q.device, dtype=torch.int32)
    # the channel-split and pipelined variants read plain keys only; quantised inputs take the default loops
    plain = win_fmt == _PLAIN and cmp_fmt == _PLAIN
    split_d, pipe = (cfg.get("SPLIT_D", 1), cfg.get("PIPE", False)) if plain and prec is None else (1, False)
    _sparse_attn_fwd[(T, B, split_d)](
        q, win, win_scales, cmp, cmp_scales, topk_idx if has_cmp else placeholder_idx, sink, out, lse, probs,
        T, E, K, window, D ** -0.5 * _LOG2E,
        H=H, D=D, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, BLOCK_N=cfg["BLOCK_N"], PREC=prec or _prec(q.dtype),
        TOPK_PROBS=topk_probs, WIN_FMT=win_fmt, CMP_FMT=cmp_fmt, SPLIT_D=split_d, PIPE=pipe, **_launch(cfg, "fwd"),
    )
    if topk_probs and not has_cmp:
        probs = torch.zeros(B, T, 0 if topk_idx is None else topk_idx.shape[2], device=q.device)
    return out, lse, (probs if topk_probs else None)


def _backward_triton(q, kv_win, kv_cmp, topk_idx, sink, window, out, lse, dout):
    B, T, H, D = q.shape
    cfg = BWD_CONFIG
    BLOCK_H, BLOCK_D = _tiles(H, D)
    keys, idx, E, K, NW = _stack_keys(q, kv_win, kv_cmp, topk_idx, window, cfg["BLOCK_N"])
    NS = NW + K
    dout = dout.contiguous()
    dq = torch.empty_like(q)
    # key gradients in the stacked layout, fp32: the top-k rows accumulated by atomics, the window rows too unless
    # cfg["window_dkv"] == "keys" gives them to the key-centric `_bwd_dkv_window`
    by_keys = cfg.get("window_dkv", "atomic") == "keys"
    dkv = torch.zeros(B * T + (B * E if K else 0), D, device=q.device, dtype=torch.float32)
    dsink_rows = torch.empty(B, T, H, device=q.device, dtype=torch.float32)
    # P and dS of one chunk of queries at a time, so the scratch stays near cfg["scratch_bytes"]
    chunk = max(1, min(T, cfg["scratch_bytes"] // (2 * B * H * NS * q.element_size())))
    p_buf = torch.empty(B * chunk * H, NS, device=q.device, dtype=q.dtype)
    ds_buf = torch.empty_like(p_buf)
    consts = dict(H=H, D=D, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, BLOCK_N=cfg["BLOCK_N"], PREC=_prec(q.dtype))
    scale = D ** -0.5
    for t0 in range(0, T, chunk):
        grid = (min(chunk, T - t0), B)
        _bwd_probs[grid](q, keys, idx, sink, out, dout, lse, p_buf, ds_buf, dsink_rows,
                         B, T, E, K, window, NW, t0, scale, scale * _LOG2E, **consts, **_launch(cfg, "probs"))
        _bwd_dq[grid](keys, idx, ds_buf, dq, B, T, E, K, window, NW, t0, **consts, **_launch(cfg, "dq"))
        if by_keys:
            j_lo = max(t0 - window + 1, 0)  # the chunk's queries see the window keys [j_lo, t0 + nq)
            win_grid = (triton.cdiv(t0 + grid[0] - j_lo, cfg["BLOCK_J"]), cfg["dkv_window_SPLIT_D"], B)
            _bwd_dkv_window[win_grid](q, dout, p_buf, ds_buf, dkv, T, window, NS, t0, grid[0], j_lo, H=H, D=D,
                                      BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, BLOCK_J=cfg["BLOCK_J"],
                                      SPLIT_D=cfg["dkv_window_SPLIT_D"], PREC=consts["PREC"],
                                      **_launch(cfg, "dkv_window"))
        if K or not by_keys:
            _bwd_dkv[grid](q, dout, idx, p_buf, ds_buf, dkv, B, T, E, K, window, NW, t0, NW if by_keys else 0,
                           **consts, UNCHAINED=cfg.get("dkv_unchained", False), **_launch(cfg, "dkv"))
    dkv_win = dkv[: B * T].view(B, T, D).to(kv_win.dtype)
    if kv_cmp is None:
        return dq, dkv_win, None, dsink_rows.sum((0, 1))
    dkv_cmp = dkv[B * T:].view(B, E, D).to(kv_cmp.dtype) if K else torch.zeros_like(kv_cmp)
    return dq, dkv_win, dkv_cmp, dsink_rows.sum((0, 1))


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv_win, kv_cmp, topk_idx, sink, window, topk_probs):
        out, lse, probs = _forward_triton(q, kv_win, kv_cmp, topk_idx, sink, window, topk_probs)
        ctx.save_for_backward(q, kv_win, kv_cmp, topk_idx, sink, out, lse)
        ctx.window = window
        if probs is None:
            return out
        ctx.mark_non_differentiable(probs)  # a detached target (the indexer learns from it, the backbone does not)
        return out, probs

    @staticmethod
    def backward(ctx, dout, *_):
        q, kv_win, kv_cmp, topk_idx, sink, out, lse = ctx.saved_tensors
        dq, dkv_win, dkv_cmp, dsink = _backward_triton(q, kv_win, kv_cmp, topk_idx, sink, ctx.window, out, lse, dout)
        return dq, dkv_win, dkv_cmp, None, dsink, None, None


_NO_QUANT_GRAD = (
    "sparse_attention: there is no backward through quantised (FP8 kv_win / FP4 kv_cmp) inputs, the inference "
    "cache's formats; run the forward under torch.no_grad() or torch.inference_mode(), or pass dequantised tensors "
    "(kernels.fp8.dequantize_fp8 / kernels.fp4.dequantize) to train"
)


class _QuantisedSparseAttention(torch.autograd.Function):
    """Forward only: quantised KV is the inference cache's format. q, sink and a plain kv argument stay visible to
    autograd, so a gradient asked of them reaches `backward`, which says why there is none (rather than a silent
    zero or a gradient that skips the keys)."""

    @staticmethod
    def forward(ctx, q, kv_win, kv_cmp, topk_idx, sink, window, topk_probs, impl, prec=None):
        if impl == "triton" and QUANT_DECODE == "separate":
            # the quantised inputs' own checks first, so an error names them rather than the dequantisation's
            _check_triton({"q": q, **_kv_tensors("kv_win", kv_win), **_kv_tensors("kv_cmp", kv_cmp),
                           "topk_idx": topk_idx, "sink": sink})
            out, _, probs = _forward_triton(q, _dequantize(kv_win, q.dtype, "triton"),
                                            _dequantize(kv_cmp, q.dtype, "triton"), topk_idx, sink, window, topk_probs)
        elif impl == "triton":
            out, _, probs = _forward_triton(q, kv_win, kv_cmp, topk_idx, sink, window, topk_probs, prec)
        else:
            res = sparse_attention_reference(q, _dequantize(kv_win, q.dtype), _dequantize(kv_cmp, q.dtype), topk_idx,
                                             sink, window, return_topk_probs=topk_probs)
            out, probs = res if topk_probs else (res, None)
        if probs is None:
            return out
        ctx.mark_non_differentiable(probs)
        return out, probs

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(_NO_QUANT_GRAD)


def _dequantize(kv, dtype: torch.dtype, impl: str = "reference"):
    """A separate dequantisation pass: a kv argument -> a plain contiguous tensor in dtype (or None)."""
    if kv is None or isinstance(kv, torch.Tensor):
        return kv
    values, scales = kv
    if values.dtype == torch.uint8:
        return fp4.dequantize(values, scales, FP4_BLOCK, impl=impl).to(dtype).contiguous()
    return fp8.dequantize_fp8(values, scales, FP8_BLOCK, impl=impl).to(dtype).contiguous()


def sparse_attention(
    q: torch.Tensor,
    kv_win: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv_cmp: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
    topk_idx: torch.Tensor | None,
    sink: torch.Tensor,
    window: int,
    *,
    return_topk_probs: bool = False,
    impl: str = "reference",
):
    """Sparse shared-KV attention: q [B, T, H, D] over the window keys of kv_win [B, T, D] and the entries of
    kv_cmp [B, E, D] selected by topk_idx [B, T, K] int32 (-1 = empty), with sink [H] fp32 -> out [B, T, H, D].

    Differentiable in q, kv_win, kv_cmp and sink for both implementations. kv_cmp may be None (window only).
    With return_topk_probs, returns (out, probs): probs [B, T, K] fp32, detached, the attention probability of each
    top-k slot summed over heads (0 for empty slots), i.e. `attend`'s p_cmp summed over heads at the selected
    entries, the target of the indexer's KL loss.

    Inference-cache formats (SPEC 1.4), each argument independently: kv_win may be FP8 `(values float8_e4m3fn
    [B, T, D], scales float8_e8m0fnu [B, T, D / 32])` (`kernels.fp8.quantize_fp8(x, block=32)`), kv_cmp FP4
    `(codes uint8 [B, E, D / 2], scales float8_e4m3fn [B, E, D / 16])` (`kernels.fp4.quantize(x, 16, "e4m3")`).
    The Triton kernel dequantises them tile by tile as it loads them; the reference dequantises them first. The
    result equals the plain call on the dequantised tensors cast to q's dtype. Forward only: with a quantised input,
    a quantised tensor that requires grad raises here, and a backward through the output raises."""
    if impl not in _IMPLS:
        raise ValueError(f"sparse_attention: impl must be one of {list(_IMPLS)}, got {impl!r}")
    _check_inputs(q, kv_win, kv_cmp, topk_idx, sink, window)
    quantised = {n: kv for n, kv in (("kv_win", kv_win), ("kv_cmp", kv_cmp)) if isinstance(kv, tuple)}
    if quantised:
        for n, kv in quantised.items():
            # autograd cannot see inside the tuples, so a quantised tensor asking for a gradient is caught here
            if torch.is_grad_enabled() and any(t.requires_grad for t in kv):
                raise RuntimeError(f"{_NO_QUANT_GRAD} (the quantised {n} requires grad)")
        if impl == "triton" and q.dtype != torch.float32 and QUANT_DECODE == "on_load" and QUANT_FP32_QUERIES:
            # On the H200 (Triton 3.6) the 16-bit MMA fed by tiles decoded in registers returned wrong values
            # (test_quantised_bf16_matches_reference_on_dequantised). Until that is understood, quantised inputs
            # run with fp32 queries on TF32 tensor cores, and the output is cast back. That is exact: a bf16 or
            # fp16 query and a decoded key (at most 6 significant bits) are TF32 numbers, so every product is the
            # 16-bit MMA's, accumulated in fp32 as there (exact fp32 "ieee" dots ran at 0.6 TFLOP/s).
            res = _QuantisedSparseAttention.apply(q.float(), kv_win, kv_cmp, topk_idx, sink, window,
                                                  return_topk_probs, impl, "tf32")
            return (res[0].to(q.dtype), res[1]) if return_topk_probs else res.to(q.dtype)
        return _QuantisedSparseAttention.apply(q, kv_win, kv_cmp, topk_idx, sink, window, return_topk_probs, impl)
    if impl == "reference":
        return sparse_attention_reference(q, kv_win, kv_cmp, topk_idx, sink, window,
                                          return_topk_probs=return_topk_probs)
    return _SparseAttention.apply(q, kv_win, kv_cmp, topk_idx, sink, window, return_topk_probs)
