"""Lightning indexer: Triton scores (dense and pool-restricted), their backward, the hierarchical candidate pool,
and plain-PyTorch references beside each kernel (SPEC 1.2-1.3, REFERENCE A4 and B4).

Shape legend: B batch, T query tokens, E compressed entries, Hi indexer heads, Di indexer head dim, BS entries per
candidate block (8), NB = ceil(E / BS), P pool blocks per query, S = P * BS pool slots, K top-k.

Contract: `index_scores(q, w, k, ratio, q_offset=)` -> [B, T, E] fp32, score = Di^-1/2 sum_h w relu(q . k), -inf
where entry e is not visible to the query at absolute position q_offset + t (e >= (q_offset + t + 1) // ratio);
differentiable in q, w, k through visible scores only. `index_scores_pool` scores only the pool's slots [B, T, S];
`candidate_pool` picks each query's P blocks (the newest visible block always in); `select_topk` is kernels.topk.
Each takes impl="triton" or "reference" (the `*_reference` functions beside the kernels).

Design and reasoning: docs/kernels.md#indexer-kernels
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.topk import topk
from kernels.triton_common import dot, dot_prec, interpreting  # dot: exact in the CPU interpreter too

__all__ = [
    "index_scores",
    "index_scores_reference",
    "candidate_pool",
    "candidate_pool_reference",
    "index_scores_pool",
    "index_scores_pool_reference",
    "select_topk",
    "pool_to_mask",
]

_IMPLS = ("reference", "triton")
# Launch parameters for Hi=32, Di=128 on an H200 (see bench/kernel_cases/indexer.py); sized so that no kernel
# spills registers (checked with ptxas for sm_90).
SCORES_CONFIG = {
    "fwd": {"BLOCK_T": 128, "BLOCK_E": 128, "num_warps": 8, "num_stages": 3},
    "bwd_qw": {"BLOCK_T": 128, "BLOCK_E": 64, "num_warps": 8, "num_stages": 3},
    "bwd_k": {"BLOCK_T": 64, "BLOCK_E": 128, "num_warps": 8, "num_stages": 3},
}
POOL_CONFIG = {
    "fwd": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
    "bwd": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
}


# ------------------------------------------------------------------------------------------------------------------
# Dense scores
# ------------------------------------------------------------------------------------------------------------------
@triton.jit
def _scores_fwd(
    q_ptr, w_ptr, k_ptr, out_ptr, T, E, q_offset, ratio, scale,
    HI: tl.constexpr, DI: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_DI: tl.constexpr,
    PREC: tl.constexpr,
):
    # Inductor passes a Python float as fp64 (eager Triton as fp32): compute in fp32 either way
    scale = tl.cast(scale, tl.float32)
    pid_e = tl.program_id(0)
    pid_t = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_c = tl.arange(0, BLOCK_DI)
    t_ok = offs_t < T
    e_ok = offs_e < E
    c_ok = offs_c < DI
    n_vis = (q_offset + offs_t + 1) // ratio  # [BT] entries visible to each query
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    if pid_e * BLOCK_E < (q_offset + tl.minimum(pid_t * BLOCK_T + BLOCK_T, T)) // ratio:
        k = tl.load(k_ptr + (b * E + offs_e)[:, None] * DI + offs_c[None, :], mask=e_ok[:, None] & c_ok[None, :],
                    other=0.0)  # [BE, BDI]
        q_rows = q_ptr + (b * T + offs_t)[:, None] * (HI * DI) + offs_c[None, :]
        for h in range(HI):
            qh = tl.load(q_rows + h * DI, mask=t_ok[:, None] & c_ok[None, :], other=0.0)  # [BT, BDI]
            wh = tl.load(w_ptr + (b * T + offs_t) * HI + h, mask=t_ok, other=0.0)  # [BT]
            d = dot(qh, tl.trans(k), None, PREC)
            acc += wh[:, None] * tl.maximum(d, 0.0)
    vis = offs_e[None, :] < n_vis[:, None]
    out = tl.where(vis, acc * scale, float("-inf"))
    tl.store(out_ptr + (b * T + offs_t)[:, None] * E + offs_e[None, :], out, mask=t_ok[:, None] & e_ok[None, :])


@triton.jit
def _scores_bwd_qw(
    q_ptr, w_ptr, k_ptr, g_ptr, dq_ptr, dw_ptr, T, E, q_offset, ratio, scale,
    HI: tl.constexpr, DI: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_DI: tl.constexpr,
    PREC: tl.constexpr,
):
    """dq[p, h] = scale * w[p, h] * sum_e g[p, e] [q.k > 0] k[e];  dw[p, h] = scale * sum_e g[p, e] relu(q.k)."""
    # Inductor passes a Python float as fp64 (eager Triton as fp32): compute in fp32 either way
    scale = tl.cast(scale, tl.float32)
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.arange(0, BLOCK_E)
    offs_c = tl.arange(0, BLOCK_DI)
    t_ok = offs_t < T
    c_ok = offs_c < DI
    qd_offs = ((b * T + offs_t) * HI + h)[:, None] * DI + offs_c[None, :]
    qh = tl.load(q_ptr + qd_offs, mask=t_ok[:, None] & c_ok[None, :], other=0.0)
    wh = tl.load(w_ptr + (b * T + offs_t) * HI + h, mask=t_ok, other=0.0) * scale
    n_vis = (q_offset + offs_t + 1) // ratio
    dq = tl.zeros([BLOCK_T, BLOCK_DI], tl.float32)
    dw = tl.zeros([BLOCK_T], tl.float32)
    e_end = tl.minimum(E, (q_offset + tl.minimum(pid_t * BLOCK_T + BLOCK_T, T)) // ratio)
    for e0 in range(0, e_end, BLOCK_E):
        offs_e = e0 + offs_n
        k = tl.load(k_ptr + (b * E + offs_e)[:, None] * DI + offs_c[None, :],
                    mask=(offs_e < E)[:, None] & c_ok[None, :], other=0.0)
        # the gradient of a -inf (invisible) score is dropped: it does not depend on the inputs
        vis = t_ok[:, None] & (offs_e[None, :] < n_vis[:, None]) & (offs_e < E)[None, :]
        g = tl.load(g_ptr + (b * T + offs_t)[:, None] * E + offs_e[None, :], mask=vis, other=0.0)
        d = dot(qh, tl.trans(k), None, PREC)  # [BT, BE]
        dw += tl.sum(g * tl.maximum(d, 0.0), 1)
        dd = tl.where(d > 0, g * wh[:, None], 0.0)
        dq = dot(dd.to(k.dtype), k, dq, PREC)
    tl.store(dq_ptr + qd_offs, dq.to(dq_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])
    tl.store(dw_ptr + (b * T + offs_t) * HI + h, dw * scale, mask=t_ok)


@triton.jit
def _scores_bwd_k(
    q_ptr, w_ptr, k_ptr, g_ptr, dk_ptr, T, E, q_offset, ratio, scale,
    HI: tl.constexpr, DI: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_DI: tl.constexpr,
    PREC: tl.constexpr,
):
    """dk[e] = scale * sum_{p, h} w[p, h] g[p, e] [q.k > 0] q[p, h], over the queries that see e."""
    # Inductor passes a Python float as fp64 (eager Triton as fp32): compute in fp32 either way
    scale = tl.cast(scale, tl.float32)
    pid_e = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_n = tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, BLOCK_DI)
    e_ok = offs_e < E
    c_ok = offs_c < DI
    k = tl.load(k_ptr + (b * E + offs_e)[:, None] * DI + offs_c[None, :], mask=e_ok[:, None] & c_ok[None, :],
                other=0.0)
    dk = tl.zeros([BLOCK_E, BLOCK_DI], tl.float32)
    # entry e is seen by queries p >= (e + 1) * ratio - 1 - q_offset
    t_first = tl.maximum((pid_e * BLOCK_E + 1) * ratio - 1 - q_offset, 0)
    for t0 in range((t_first // BLOCK_T) * BLOCK_T, T, BLOCK_T):
        offs_t = t0 + offs_n
        t_ok = offs_t < T
        n_vis = (q_offset + offs_t + 1) // ratio
        vis = t_ok[None, :] & (offs_e[:, None] < n_vis[None, :]) & e_ok[:, None]  # [BE, BT]
        g_t = tl.load(g_ptr + (b * T + offs_t)[None, :] * E + offs_e[:, None], mask=vis, other=0.0)
        for h in range(HI):
            qh = tl.load(q_ptr + ((b * T + offs_t) * HI + h)[:, None] * DI + offs_c[None, :],
                         mask=t_ok[:, None] & c_ok[None, :], other=0.0)  # [BT, BDI]
            wh = tl.load(w_ptr + (b * T + offs_t) * HI + h, mask=t_ok, other=0.0) * scale
            d_t = dot(k, tl.trans(qh), None, PREC)  # [BE, BT]
            dd_t = tl.where(d_t > 0, g_t * wh[None, :], 0.0)
            dk = dot(dd_t.to(qh.dtype), qh, dk, PREC)
    tl.store(dk_ptr + (b * E + offs_e)[:, None] * DI + offs_c[None, :], dk.to(dk_ptr.dtype.element_ty),
             mask=e_ok[:, None] & c_ok[None, :])


# ------------------------------------------------------------------------------------------------------------------
# Candidate pool and pool-restricted scores
# ------------------------------------------------------------------------------------------------------------------
@triton.jit
def _block_max(
    s_ptr, out_ptr, T, E, NB, q_offset, ratio,
    BS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """[B, T, E] masked scores -> [B, T, NB] block maxima, the block of the newest visible entry forced to +inf."""
    pid_nb = tl.program_id(0)
    pid_t = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_blk = pid_nb * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_e = pid_nb * BLOCK_B * BS + tl.arange(0, BLOCK_B * BS)
    t_ok = offs_t < T
    s = tl.load(s_ptr + (b * T + offs_t)[:, None] * E + offs_e[None, :],
                mask=t_ok[:, None] & (offs_e < E)[None, :], other=float("-inf"))
    blk = tl.max(tl.reshape(s, [BLOCK_T, BLOCK_B, BS]), 2)  # padding past E is -inf, as the reference pads
    newest = (q_offset + offs_t + 1) // ratio - 1  # -1: nothing visible yet, so nothing is forced
    forced = (offs_blk[None, :] == (newest // BS)[:, None]) & (newest >= 0)[:, None]
    blk = tl.where(forced, float("inf"), blk)
    tl.store(out_ptr + (b * T + offs_t)[:, None] * NB + offs_blk[None, :], blk,
             mask=t_ok[:, None] & (offs_blk < NB)[None, :])


@triton.jit
def _pool_slots(pool_ptr, k_ptr, row, b, E, P, n_vis, s0, offs_n, offs_c, c_ok, DI: tl.constexpr, BS: tl.constexpr):
    """Slots s0 + offs_n of one query's pool -> (entry ids, valid, key tile [BN, BDI])."""
    slot = s0 + offs_n
    blk = tl.load(pool_ptr + row * P + slot // BS, mask=slot < P * BS, other=-1)
    ent = blk * BS + slot % BS
    valid = (blk >= 0) & (ent < n_vis) & (ent < E)
    k = tl.load(k_ptr + (b * E + ent)[:, None] * DI + offs_c[None, :], mask=valid[:, None] & c_ok[None, :],
                other=0.0)
    return ent, valid, k


@triton.jit
def _pool_fwd(
    q_ptr, w_ptr, k_ptr, pool_ptr, out_ptr, T, E, P, q_offset, ratio, scale,
    HI: tl.constexpr, DI: tl.constexpr, BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DI: tl.constexpr,
    BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    # Inductor passes a Python float as fp64 (eager Triton as fp32): compute in fp32 either way
    scale = tl.cast(scale, tl.float32)
    t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row = b * T + t
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_DI)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < HI
    c_ok = offs_c < DI
    q = tl.load(q_ptr + (row * HI + offs_h)[:, None] * DI + offs_c[None, :], mask=h_ok[:, None] & c_ok[None, :],
                other=0.0)  # [BH, BDI]
    w = tl.load(w_ptr + row * HI + offs_h, mask=h_ok, other=0.0) * scale
    n_vis = (q_offset + t + 1) // ratio
    for s0 in range(0, P * BS, BLOCK_N):
        ent, valid, k = _pool_slots(pool_ptr, k_ptr, row, b, E, P, n_vis, s0, offs_n, offs_c, c_ok, DI, BS)
        # entries on the M axis (>= 64 rows for the tensor cores), heads on N
        d_t = dot(k, tl.trans(q), None, PREC)  # [BN, BH]
        sc = tl.sum(tl.maximum(d_t, 0.0) * w[None, :], 1)
        slot = s0 + offs_n
        tl.store(out_ptr + row * (P * BS) + slot, tl.where(valid, sc, float("-inf")), mask=slot < P * BS)


@triton.jit
def _pool_bwd(
    q_ptr, w_ptr, k_ptr, pool_ptr, g_ptr, dq_ptr, dw_ptr, dk_ptr, T, E, P, q_offset, ratio, scale,
    HI: tl.constexpr, DI: tl.constexpr, BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DI: tl.constexpr,
    BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):
    # Inductor passes a Python float as fp64 (eager Triton as fp32): compute in fp32 either way
    scale = tl.cast(scale, tl.float32)
    t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row = b * T + t
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_DI)
    offs_n = tl.arange(0, BLOCK_N)
    h_ok = offs_h < HI
    c_ok = offs_c < DI
    hc_offs = (row * HI + offs_h)[:, None] * DI + offs_c[None, :]
    q = tl.load(q_ptr + hc_offs, mask=h_ok[:, None] & c_ok[None, :], other=0.0)
    w = tl.load(w_ptr + row * HI + offs_h, mask=h_ok, other=0.0) * scale
    n_vis = (q_offset + t + 1) // ratio
    dq_t = tl.zeros([BLOCK_DI, BLOCK_H], tl.float32)
    dw = tl.zeros([BLOCK_H], tl.float32)
    for s0 in range(0, P * BS, BLOCK_N):
        ent, valid, k = _pool_slots(pool_ptr, k_ptr, row, b, E, P, n_vis, s0, offs_n, offs_c, c_ok, DI, BS)
        g = tl.load(g_ptr + row * (P * BS) + s0 + offs_n, mask=valid, other=0.0)  # [BN]
        d_t = dot(k, tl.trans(q), None, PREC)  # [BN, BH]
        dw += tl.sum(g[:, None] * tl.maximum(d_t, 0.0), 0)
        dd_t = tl.where(d_t > 0, g[:, None] * w[None, :], 0.0).to(k.dtype)
        dq_t = dot(tl.trans(k), dd_t, dq_t, PREC)  # [BDI, BH]
        # an entry can sit in many queries' pools: scatter its key gradient with atomics
        dk = dot(dd_t, q, None, PREC)  # [BN, BDI]
        tl.atomic_add(dk_ptr + (b * E + ent)[:, None] * DI + offs_c[None, :], dk,
                      mask=valid[:, None] & c_ok[None, :], sem="relaxed")
    tl.store(dq_ptr + (row * HI + offs_h)[None, :] * DI + offs_c[:, None], dq_t.to(dq_ptr.dtype.element_ty),
             mask=h_ok[None, :] & c_ok[:, None])
    tl.store(dw_ptr + row * HI + offs_h, dw * scale, mask=h_ok)


# ------------------------------------------------------------------------------------------------------------------
# Host wrappers
# ------------------------------------------------------------------------------------------------------------------
def _check_impl(impl: str, name: str) -> None:
    if impl not in _IMPLS:
        raise ValueError(f"{name}: impl must be one of {list(_IMPLS)}, got {impl!r}")


def _check_qwk(q, w, k, ratio, q_offset, name) -> tuple[int, int, int, int, int]:
    """Validate the indexer inputs; return (B, T, Hi, Di, E)."""
    if q.dim() != 4:
        raise ValueError(f"{name}: q must be [B, T, Hi, Di], got shape {tuple(q.shape)}")
    B, T, Hi, Di = q.shape
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name}: q must be bf16/fp16/fp32, got {q.dtype}")
    if tuple(w.shape) != (B, T, Hi) or w.dtype != torch.float32:
        raise ValueError(f"{name}: w must be fp32 [B, T, Hi] = {(B, T, Hi)}, got {w.dtype} {tuple(w.shape)}")
    if k.dim() != 3 or k.shape[0] != B or k.shape[2] != Di:
        raise ValueError(f"{name}: k must be [B, E, Di] with B={B}, Di={Di}, got {tuple(k.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"{name}: k must have q's dtype {q.dtype}, got {k.dtype}")
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"{name}: ratio must be a positive int, got {ratio!r}")
    if isinstance(q_offset, bool) or not isinstance(q_offset, int) or q_offset < 0:
        raise ValueError(f"{name}: q_offset must be a non-negative int, got {q_offset!r}")
    for n, t in (("w", w), ("k", k)):
        if t.device != q.device:
            raise ValueError(f"{name}: {n} is on {t.device}, q on {q.device}")
    return B, T, Hi, Di, k.shape[1]


def _check_triton(name: str, **tensors: torch.Tensor) -> None:
    for n, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"{name}(impl='triton'): {n} must be contiguous (call .contiguous())")
        if t.device.type != "cuda" and not interpreting():
            raise RuntimeError(f"{name}(impl='triton'): {n} is on {t.device}; the Triton kernel needs CUDA tensors "
                               "(or TRITON_INTERPRET=1 for the CPU interpreter)")


def _visible(T: int, E: int, ratio: int, q_offset: int, device) -> torch.Tensor:
    """[T, E] bool: entry e visible to the query at absolute position q_offset + p."""
    p = torch.arange(T, device=device) + q_offset
    return torch.arange(E, device=device)[None, :] < ((p + 1) // ratio)[:, None]


class _IndexScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, w, k, ratio, q_offset):
        B, T, Hi, Di, E = q.shape[0], q.shape[1], q.shape[2], q.shape[3], k.shape[1]
        cfg = SCORES_CONFIG["fwd"]
        out = torch.empty(B, T, E, device=q.device, dtype=torch.float32)
        consts = dict(HI=Hi, DI=Di, BLOCK_DI=max(16, triton.next_power_of_2(Di)), PREC=dot_prec(q.dtype))
        grid = (triton.cdiv(E, cfg["BLOCK_E"]), triton.cdiv(T, cfg["BLOCK_T"]), B)
        _scores_fwd[grid](q, w, k, out, T, E, q_offset, ratio, Di ** -0.5, **consts, **cfg)
        ctx.save_for_backward(q, w, k)
        ctx.args = (ratio, q_offset, consts)
        return out

    @staticmethod
    def backward(ctx, g):
        q, w, k = ctx.saved_tensors
        ratio, q_offset, consts = ctx.args
        B, T, Hi, Di, E = q.shape[0], q.shape[1], q.shape[2], q.shape[3], k.shape[1]
        g = g.contiguous().float()
        dq = torch.empty_like(q)
        dw = torch.empty_like(w)
        dk = torch.empty_like(k)
        cfg = SCORES_CONFIG["bwd_qw"]
        _scores_bwd_qw[(triton.cdiv(T, cfg["BLOCK_T"]), Hi, B)](
            q, w, k, g, dq, dw, T, E, q_offset, ratio, Di ** -0.5, **consts, **cfg)
        cfg = SCORES_CONFIG["bwd_k"]
        _scores_bwd_k[(triton.cdiv(E, cfg["BLOCK_E"]), B)](
            q, w, k, g, dk, T, E, q_offset, ratio, Di ** -0.5, **consts, **cfg)
        return dq, dw, dk, None, None


def index_scores(q, w, k, ratio: int, *, q_offset: int = 0, impl: str = "reference") -> torch.Tensor:
    """q [B, T, Hi, Di], w [B, T, Hi] fp32, k [B, E, Di] -> masked scores [B, T, E] fp32 (-inf = not visible).
    Differentiable in q, w and k (the indexer's KL loss)."""
    _check_impl(impl, "index_scores")
    _check_qwk(q, w, k, ratio, q_offset, "index_scores")
    if impl == "reference":
        return index_scores_reference(q, w, k, ratio, q_offset=q_offset)
    _check_triton("index_scores", q=q, w=w, k=k)
    return _IndexScores.apply(q, w, k, ratio, q_offset)


def index_scores_reference(q, w, k, ratio: int, *, q_offset: int = 0) -> torch.Tensor:
    """`model.csa2.index_scores` masked with the causal visibility rule."""
    dots = torch.einsum("bthd,bed->bthe", q.float(), k.float()).relu()
    scores = torch.einsum("bthe,bth->bte", dots, w) * q.shape[-1] ** -0.5
    vis = _visible(q.shape[1], k.shape[1], ratio, q_offset, q.device)
    return scores.masked_fill(~vis, float("-inf"))


def candidate_pool(scores, ratio: int, block_size: int, topk_blocks: int, *, q_offset: int = 0,
                   impl: str = "reference") -> torch.Tensor:
    """Masked scores [B, T, E] -> pool [B, T, P] int32 block ids (-1 = empty), P = min(topk_blocks, NB).

    A block's score is the max over its `block_size` entries; the block of the query's newest visible entry is
    always kept; the best blocks with a finite score make the pool (SPEC 1.3, REFERENCE A4)."""
    _check_impl(impl, "candidate_pool")
    if scores.dim() != 3 or scores.dtype != torch.float32:
        raise ValueError(f"candidate_pool: scores must be fp32 [B, T, E], got {scores.dtype} {tuple(scores.shape)}")
    for n, v, lo in (("ratio", ratio, 1), ("block_size", block_size, 1), ("topk_blocks", topk_blocks, 1),
                     ("q_offset", q_offset, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"candidate_pool: {n} must be an int >= {lo}, got {v!r}")
    if impl == "reference":
        return candidate_pool_reference(scores, ratio, block_size, topk_blocks, q_offset=q_offset)
    if block_size & (block_size - 1):
        raise ValueError(f"candidate_pool(impl='triton'): block_size must be a power of two, got {block_size}")
    _check_triton("candidate_pool", scores=scores)
    B, T, E = scores.shape
    NB = triton.cdiv(E, block_size)
    blocks = torch.empty(B, T, NB, device=scores.device, dtype=torch.float32)
    BLOCK_T, BLOCK_B = 32, max(1, 256 // block_size)
    grid = (triton.cdiv(NB, BLOCK_B), triton.cdiv(T, BLOCK_T), B)
    _block_max[grid](scores, blocks, T, E, NB, q_offset, ratio, BS=block_size, BLOCK_T=BLOCK_T, BLOCK_B=BLOCK_B)
    return _top_blocks(blocks, topk_blocks, impl="triton")


def _top_blocks(blocks: torch.Tensor, topk_blocks: int, impl: str = "reference") -> torch.Tensor:
    vals, ids = topk(blocks, min(topk_blocks, blocks.shape[-1]), impl=impl)
    return torch.where(vals > float("-inf"), ids, -1).to(torch.int32)


def candidate_pool_reference(scores, ratio: int, block_size: int, topk_blocks: int, *, q_offset: int = 0):
    """`model.csa2.candidate_pool`, returning block ids instead of an entry mask."""
    B, T, E = scores.shape
    NB = -(-E // block_size)
    s = torch.nn.functional.pad(scores, (0, NB * block_size - E), value=float("-inf"))
    blocks = s.view(B, T, NB, block_size).amax(-1)
    newest = (torch.arange(T, device=scores.device) + q_offset + 1) // ratio - 1
    blk = torch.arange(NB, device=scores.device)
    forced = (blk[None, :] == (newest // block_size)[:, None]) & (newest >= 0)[:, None]
    return _top_blocks(blocks.masked_fill(forced, float("inf")), topk_blocks)


def pool_to_mask(pool: torch.Tensor, num_entries: int, block_size: int) -> torch.Tensor:
    """Pool block ids [B, T, P] (-1 = empty) -> [B, T, E] bool entry mask (the `ctx.pool` of the model)."""
    B, T, _ = pool.shape
    NB = -(-num_entries // block_size)
    keep = torch.zeros(B, T, NB + 1, dtype=torch.bool, device=pool.device)
    keep.scatter_(-1, torch.where(pool < 0, NB, pool).long(), True)
    return keep[..., :NB].repeat_interleave(block_size, dim=-1)[..., :num_entries]


def _pool_entries(pool: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, T, P] block ids -> [B, T, P * BS] entry ids (negative where the block is empty)."""
    ent = pool.long()[..., None] * block_size + torch.arange(block_size, device=pool.device)
    return torch.where(pool[..., None] >= 0, ent, -1).flatten(-2)


class _PoolScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, w, k, pool, ratio, block_size, q_offset):
        B, T, Hi, Di = q.shape
        E, P = k.shape[1], pool.shape[2]
        out = torch.empty(B, T, P * block_size, device=q.device, dtype=torch.float32)
        consts = dict(HI=Hi, DI=Di, BS=block_size, BLOCK_H=max(16, triton.next_power_of_2(Hi)),
                      BLOCK_DI=max(16, triton.next_power_of_2(Di)), PREC=dot_prec(q.dtype))
        _pool_fwd[(T, B)](q, w, k, pool, out, T, E, P, q_offset, ratio, Di ** -0.5, **consts,
                          **POOL_CONFIG["fwd"])
        ctx.save_for_backward(q, w, k, pool)
        ctx.args = (ratio, q_offset, consts)
        return out

    @staticmethod
    def backward(ctx, g):
        q, w, k, pool = ctx.saved_tensors
        ratio, q_offset, consts = ctx.args
        B, T, Hi, Di = q.shape
        E, P = k.shape[1], pool.shape[2]
        dq = torch.empty_like(q)
        dw = torch.empty_like(w)
        dk = torch.zeros(B, E, Di, device=k.device, dtype=torch.float32)  # atomics accumulate in fp32
        _pool_bwd[(T, B)](q, w, k, pool, g.contiguous().float(), dq, dw, dk, T, E, P, q_offset, ratio, Di ** -0.5,
                          **consts, **POOL_CONFIG["bwd"])
        return dq, dw, dk.to(k.dtype), None, None, None, None


def index_scores_pool(q, w, k, pool, ratio: int, block_size: int, *, q_offset: int = 0,
                      impl: str = "reference") -> torch.Tensor:
    """Reindex scoring over the candidate pool only: pool [B, T, P] int32 block ids (-1 = empty) ->
    scores [B, T, P * BS] fp32, slot i*BS + j scoring entry pool[..., i]*BS + j (-inf: empty, invisible or >= E).
    Differentiable in q, w and k. Pool block ids must be distinct per query (as `candidate_pool` gives)."""
    _check_impl(impl, "index_scores_pool")
    B, T, _, _, _ = _check_qwk(q, w, k, ratio, q_offset, "index_scores_pool")
    if pool.dim() != 3 or tuple(pool.shape[:2]) != (B, T) or pool.dtype != torch.int32:
        raise ValueError(f"index_scores_pool: pool must be int32 [B, T, P] = [{B}, {T}, P], "
                         f"got {pool.dtype} {tuple(pool.shape)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"index_scores_pool: block_size must be a positive int, got {block_size!r}")
    if impl == "reference":
        return index_scores_pool_reference(q, w, k, pool, ratio, block_size, q_offset=q_offset)
    _check_triton("index_scores_pool", q=q, w=w, k=k, pool=pool)
    return _PoolScores.apply(q, w, k, pool, ratio, block_size, q_offset)


def index_scores_pool_reference(q, w, k, pool, ratio: int, block_size: int, *, q_offset: int = 0):
    """Gather-based PyTorch: each query's pool entries [B, T, S, Di] scored against its own heads."""
    B, T, Hi, Di = q.shape
    E = k.shape[1]
    ent = _pool_entries(pool, block_size)  # [B, T, S]
    n_vis = (torch.arange(T, device=q.device) + q_offset + 1) // ratio
    valid = (ent >= 0) & (ent < n_vis[None, :, None]) & (ent < E)
    S = ent.shape[-1]
    keys = k.float().gather(1, ent.clamp(0, max(E - 1, 0)).reshape(B, T * S, 1).expand(B, T * S, Di))
    dots = torch.einsum("bthd,btsd->bths", q.float(), keys.view(B, T, S, Di)).relu()
    scores = torch.einsum("bths,bth->bts", dots, w) * Di ** -0.5
    return scores.masked_fill(~valid, float("-inf"))


def select_topk(scores: torch.Tensor, k: int, *, pool: torch.Tensor | None = None,
                block_size: int = 8, impl: str = "reference") -> torch.Tensor:
    """Top-k entry ids [B, T, min(k, S)] int32 (-1 where the pick is -inf, i.e. fewer allowed entries than k).

    `scores` are dense [B, T, E] or, with `pool`, the slot scores of `index_scores_pool` (ids map back through the
    pool). Unsorted. impl="reference" is torch.topk, whose tie-breaking is unspecified (REFERENCE A4); "triton" is
    `kernels.topk`, which keeps the lowest positions among scores tied at the k-th value."""
    kk = min(k, scores.shape[-1])
    vals, pos = topk(scores.contiguous() if impl == "triton" else scores, kk, impl=impl)
    pos = pos.long()
    if pool is not None:
        ent = pool.gather(-1, pos // block_size).long() * block_size + pos % block_size
    else:
        ent = pos
    return torch.where(vals > float("-inf"), ent, -1).to(torch.int32)
