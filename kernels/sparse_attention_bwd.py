"""Triton backward kernels of the sparse shared-KV attention (`kernels.sparse_attention` launches them, one chunk of
queries at a time; the dot and mask helpers it shares with the forward come from kernels/triton_common.py).

Contract: three launches per chunk, none with a chained dot: `bwd_probs` writes P and dS * scale for every (head,
slot) to a scratch buffer in the input dtype and the sink's gradient per row; `bwd_dq` reduces dq over the gathered
keys; `bwd_dkv` scatter-adds the key (= value) gradient into fp32 with atomics, so the last bits of dkv vary run to
run. Slots [0, NW) are the window keys, [NW, NW + K) the top-k entries; the host stacks kv_win and kv_cmp into one
tensor so one loop walks both.

Design and reasoning: docs/kernels.md#sparse-attention-backward-kernels
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_common import dot, rows_mask


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
def _probs_from_logits(s, dp, valid, lse, delta, scale, p_ptrs, ds_ptrs, store_ok):
    """Logits s (log2 units) and dO.V dp [BH, BN] of one key block -> P and dS * scale, stored."""
    p = tl.where(valid[None, :], tl.exp2(s - lse[:, None]), 0.0)
    ds = p * (dp - delta[:, None]) * scale
    tl.store(p_ptrs, p.to(p_ptrs.dtype.element_ty), mask=store_ok)
    tl.store(ds_ptrs, ds.to(ds_ptrs.dtype.element_ty), mask=store_ok)


@triton.jit
def _probs_block(q, do, k, valid, lse, delta, scale, qk_scale, p_ptrs, ds_ptrs, store_ok, PREC: tl.constexpr):
    s = dot(q, tl.trans(k), None, PREC) * qk_scale  # [BH, BN]
    dp = dot(do, tl.trans(k), None, PREC)  # dO . V with V = K
    _probs_from_logits(s, dp, valid, lse, delta, scale, p_ptrs, ds_ptrs, store_ok)


@triton.jit
def _stacked_rows(q_ptr, dout_ptr, base, offs_c, H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """[q; dO] of one query, channels offs_c -> [2BH, C]: rows < BH are q's heads, the rest dO's; 0 in padded
    heads and channels. Two masked loads (each row is read by one of them), not one load through a per-row pointer
    select: the compiler then knows each base pointer's alignment and issues 16-byte loads."""
    offs_r = tl.arange(0, 2 * BLOCK_H)
    first = offs_r < BLOCK_H
    h2 = tl.where(first, offs_r, offs_r - BLOCK_H)
    offs = base + h2[:, None] * D + offs_c[None, :]
    ok = rows_mask(h2 < H, offs_c, D, D == BLOCK_D)
    return tl.where(first[:, None], tl.load(q_ptr + offs, mask=ok & first[:, None], other=0.0),
                    tl.load(dout_ptr + offs, mask=ok & ~first[:, None], other=0.0))


@triton.jit
def _row_dot(a_ptr, b_ptr, base, h_ok, H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
             BLOCK_D: tl.constexpr):
    """rowsum(a * b) in fp32 over the [BH, D] rows at base, 64 channels at a time (so the two [BH, BD] tiles are
    never live at once: the stacked kernel needs the registers for its [2BH, BD] operand)."""
    DC: tl.constexpr = 64 if BLOCK_D > 64 else BLOCK_D
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, DC)
    acc = tl.zeros([BLOCK_H], tl.float32)
    for c0 in tl.static_range(0, BLOCK_D, DC):
        offs = base + offs_h[:, None] * D + (c0 + offs_c)[None, :]
        ok = rows_mask(h_ok, c0 + offs_c, D, D == BLOCK_D)
        a = tl.load(a_ptr + offs, mask=ok, other=0.0)
        b = tl.load(b_ptr + offs, mask=ok, other=0.0)
        acc += tl.sum(a.to(tl.float32) * b.to(tl.float32), 1)
    return acc


@triton.jit
def bwd_probs(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, dout_ptr, lse_ptr, p_ptr, ds_ptr, dsink_ptr,
    B, T, E, K, window, NW, t0, scale, qk_scale,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr, STACKED: tl.constexpr, PROBS_N: tl.constexpr,
):
    """Per query: P = exp(logits - lse) and dS * scale = P * (dO.V - rowsum(dO * O)) * scale for every slot.

    STACKED: the logits and dO.V of a key block come from one dot of the stacked [q; dO] ([2BH, BD]) with the keys,
    split into its two halves afterwards; else from two dots with BH rows each (the previous kernel). Key blocks
    of PROBS_N slots (a divisor of BLOCK_N: every slot from the BLOCK_N-aligned start on is written, as the other
    two kernels read them)."""
    # Inductor passes a Python float as fp64 (eager Triton as fp32): compute in fp32 either way
    scale = tl.cast(scale, tl.float32)
    qk_scale = tl.cast(qk_scale, tl.float32)
    FULL: tl.constexpr = D == BLOCK_D
    t = t0 + tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, PROBS_N)
    h_ok = offs_h < H
    hd_ok = rows_mask(h_ok, offs_d, D, FULL)
    row = b * T + t
    if STACKED:
        delta = _row_dot(dout_ptr, out_ptr, row * H * D, h_ok, H, D, BLOCK_H, BLOCK_D)
    else:
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
    if STACKED:
        qd = _stacked_rows(q_ptr, dout_ptr, row * H * D, offs_d, H, D, BLOCK_H, BLOCK_D)  # [2BH, BD]
    for n0 in range(n_lo, NS, PROBS_N):
        rows, valid = _slot_rows(idx_ptr, row, b, t, B, T, E, K, window, NW, n0, offs_n)
        k = tl.load(kv_ptr + rows[:, None] * D + offs_d[None, :], mask=rows_mask(valid, offs_d, D, FULL), other=0.0)
        s_offs = (srow + offs_h)[:, None] * NS + (n0 + offs_n)[None, :]
        store_ok = h_ok[:, None] & (n0 + offs_n < NS)[None, :]
        if STACKED:
            # [2BH, BN] -> logits (rows < BH) and dO.V (the rest): one dot with twice the rows, so each warpgroup
            # owns one of them (m64n64 tiles at BN = 64, where two BH-row dots split BN between the warpgroups)
            s, dp = tl.split(tl.permute(tl.reshape(dot(qd, tl.trans(k), None, PREC), (2, BLOCK_H, PROBS_N)),
                                        (1, 2, 0)))
            _probs_from_logits(s * qk_scale, dp, valid, lse, delta, scale, p_ptr + s_offs, ds_ptr + s_offs, store_ok)
        else:
            _probs_block(q, do, k, valid, lse, delta, scale, qk_scale, p_ptr + s_offs, ds_ptr + s_offs, store_ok,
                         PREC)


@triton.jit
def bwd_dq(
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
        k = tl.load(kv_ptr + rows[:, None] * D + offs_d[None, :], mask=rows_mask(valid, offs_d, D, FULL), other=0.0)
        ds = tl.load(ds_ptr + (srow + offs_h)[:, None] * NS + (n0 + offs_n)[None, :],
                     mask=h_ok[:, None] & (n0 + offs_n < NS)[None, :], other=0.0)
        dq = dot(ds, k, dq, PREC)
    tl.store(dq_ptr + row * H * D + offs_h[:, None] * D + offs_d[None, :], dq.to(dq_ptr.dtype.element_ty),
             mask=rows_mask(h_ok, offs_d, D, FULL))


@triton.jit
def bwd_dkv(
    q_ptr, dout_ptr, idx_ptr, p_ptr, ds_ptr, dkv_ptr,
    B, T, E, K, window, NW, t0, n_q,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr, SPLIT_LOADS: tl.constexpr, PERSISTENT: tl.constexpr,
):
    """Per query and slot block: dkv[key] += (dS * scale)^T q + P^T dO, added atomically into fp32 rows.
    K = V, so the key gradient and the value gradient land on the same row. The columns go in two halves: a
    [BN, D] fp32 tile (and the layout change before its atomics) would not fit on chip.

    The chunk's n_q queries start at t0. One program per query, or with PERSISTENT a smaller grid whose programs
    loop over the queries (so the launch holds only part of the GPU: the host runs it beside the next chunk's
    other launches).

    SPLIT_LOADS: the stacked operands [q; dO] and [dS; P] come from two masked loads each, so the compiler sees
    each base pointer's alignment and issues 16-byte loads; else from one load through a per-row pointer select
    (the previous kernel), which it reads as one 16-bit element per load instruction (sm_90 PTX)."""
    b = tl.program_id(1).to(tl.int64)
    if PERSISTENT:
        for i in range(tl.program_id(0), n_q, tl.num_programs(0)):
            _dkv_query(q_ptr, dout_ptr, idx_ptr, p_ptr, ds_ptr, dkv_ptr, B, T, E, K, window, NW, t0, n_q, i, b,
                       H, D, BLOCK_H, BLOCK_D, BLOCK_N, PREC, SPLIT_LOADS)
    else:
        _dkv_query(q_ptr, dout_ptr, idx_ptr, p_ptr, ds_ptr, dkv_ptr, B, T, E, K, window, NW, t0, n_q,
                   tl.program_id(0), b, H, D, BLOCK_H, BLOCK_D, BLOCK_N, PREC, SPLIT_LOADS)


@triton.jit
def _dkv_query(
    q_ptr, dout_ptr, idx_ptr, p_ptr, ds_ptr, dkv_ptr,
    B, T, E, K, window, NW, t0, n_q, i, b,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr, SPLIT_LOADS: tl.constexpr,
):
    """`bwd_dkv` for query i of the chunk (batch row b)."""
    FULL: tl.constexpr = D == BLOCK_D
    HALF: tl.constexpr = BLOCK_D // 2
    t = t0 + i
    offs_c = tl.arange(0, HALF)
    offs_n = tl.arange(0, BLOCK_N)
    row = b * T + t
    NS = NW + K
    srow = (i + b * n_q) * H  # this query's first row in the chunk's scratch [B*n_q*H, NS]
    n_lo = (tl.maximum(window - 1 - t, 0) // BLOCK_N) * BLOCK_N
    # One dot with K = 2H per half: [dS | P]^T [q; dO] (rows < BH: dS with q; the rest: P with dO). Two dots into
    # one accumulator would count as chained, and the first would get all warps on M: with BN = 64 both
    # warpgroups would compute it (TTGIR for sm_90).
    offs_r = tl.arange(0, 2 * BLOCK_H)
    first = offs_r < BLOCK_H
    h2 = tl.where(first, offs_r, offs_r - BLOCK_H)
    r_ok = h2 < H
    if SPLIT_LOADS:
        qd_lo = _stacked_rows(q_ptr, dout_ptr, row * H * D, offs_c, H, D, BLOCK_H, BLOCK_D)
        qd_hi = _stacked_rows(q_ptr, dout_ptr, row * H * D, offs_c + HALF, H, D, BLOCK_H, BLOCK_D)
    else:
        qd_base = tl.where(first, q_ptr, dout_ptr) + row * H * D + h2 * D  # [2BH] row pointers
        qd_lo = tl.load(qd_base[:, None] + offs_c[None, :], mask=rows_mask(r_ok, offs_c, D, FULL), other=0.0)
        qd_hi = tl.load(qd_base[:, None] + (offs_c + HALF)[None, :], mask=rows_mask(r_ok, offs_c + HALF, D, FULL),
                        other=0.0)
        pd_base = tl.where(first, ds_ptr, p_ptr) + (srow + h2) * NS  # [2BH]
    for n0 in range(n_lo, NS, BLOCK_N):
        rows, valid = _slot_rows(idx_ptr, row, b, t, B, T, E, K, window, NW, n0, offs_n)
        pd_ok = r_ok[:, None] & (n0 + offs_n < NS)[None, :]
        if SPLIT_LOADS:
            pd_offs = ((srow + h2) * NS)[:, None] + (n0 + offs_n)[None, :]
            pd = tl.where(first[:, None], tl.load(ds_ptr + pd_offs, mask=pd_ok & first[:, None], other=0.0),
                          tl.load(p_ptr + pd_offs, mask=pd_ok & ~first[:, None], other=0.0))  # [2BH, BN]
        else:
            pd = tl.load(pd_base[:, None] + (n0 + offs_n)[None, :], mask=pd_ok, other=0.0)  # [2BH, BN]
        lo = dkv_ptr + rows[:, None] * D + offs_c[None, :]
        tl.atomic_add(lo, dot(tl.trans(pd), qd_lo, None, PREC), mask=rows_mask(valid, offs_c, D, FULL),
                      sem="relaxed")
        tl.atomic_add(lo + HALF, dot(tl.trans(pd), qd_hi, None, PREC),
                      mask=rows_mask(valid, offs_c + HALF, D, FULL), sem="relaxed")
