"""Triton kernels for Engram (REFERENCE A8): the table gather and the fused gate + stream update. The PyTorch
reference is `model.engram.Engram` (`lookup`, `gate`, `forward`); model.kernels.engram_forward composes these.

Shape legend: N tokens (B * T flattened), C row ids per token, L = N * C lookups, Dh table row width, R table rows,
n mHC streams, D model dim, kv the wkv output [N, (n + 1) * D] (n keys stream-major, then the value).

Contract (tensors only): `lookup(table, row_ids [...], scales, table_grad=)` -> rows [..., Dh] (a bf16/fp32 table
copied bit for bit, an FP8 table with its scales dequantised; an id outside [0, R) gives NaN rows; the table
gradient dense, or with table_grad="sparse" a COO gradient of the touched rows);
`gate_update(S [N, n, D], kv, qk, dead, eps)` -> S' = S + g * value with the reference's scalar gate, differentiable
in S, kv and qk (deterministic: no atomics in the qk reduction).

Design and reasoning: docs/kernels.md#engram-kernels
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton_common import bf16_bits, check_device, e4m3_value, e8m0_value, interpreting

__all__ = ["lookup", "gather_rows", "gate_update", "gate_fwd", "gate_bwd", "gate_from_stats"]

_NAN_BITS = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00, torch.float32: 0x7FC00000}
_BITS_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_SCALE_BLOCK = 32  # FP8 table: one scale per 32 channels (A8)


def _bits(t: torch.Tensor, gpu: bool) -> torch.Tensor:
    """Output tensors as the kernels write them: bf16 through its int16 bits in the interpreter."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 and not gpu else t


@triton.jit
def _store_rounded(ptr, val, mask, BF16: tl.constexpr, GPU: tl.constexpr):
    """fp32 -> a bf16 or fp32 tensor, rounded to nearest even: the hardware convert when compiled for the GPU,
    bit arithmetic on the tensor's int16 view in the interpreter (whose bf16 casts round wrongly)."""
    if BF16:
        if GPU:
            tl.store(ptr, val.to(tl.bfloat16), mask=mask)
        else:
            tl.store(ptr, bf16_bits(val).to(tl.int16), mask=mask)
    else:
        tl.store(ptr, val, mask=mask)


# ------------------------------------------------------------------------------------------------------------
# Gather and its gradient


@triton.jit
def _gather_kernel(table_ptr, scale_ptr, ids_ptr, out_ptr, num_lookups, num_rows, row_dim, nan_bits,
                   FP8: tl.constexpr, SCALE_E8M0: tl.constexpr, OUT_BF16: tl.constexpr, GPU: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_DH: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] lookups
    r_ok = r < num_lookups
    rid = tl.load(ids_ptr + r, mask=r_ok, other=0)
    valid = (rid >= 0) & (rid < num_rows)
    c = tl.arange(0, BLOCK_DH)
    c_ok = (c < row_dim)[None, :]
    src = rid[:, None] * row_dim + c[None, :]  # int64: the flagship table has ~10^11 elements
    m_in = valid[:, None] & c_ok
    m_out = r_ok[:, None] & c_ok
    dst = out_ptr + r[:, None] * row_dim + c[None, :]
    if FP8:
        code = tl.load(table_ptr + src, mask=m_in, other=0).to(tl.int32)
        s_offs = rid[:, None] * (row_dim // 32) + (c // 32)[None, :]
        if SCALE_E8M0:
            scale = e8m0_value(tl.load(scale_ptr + s_offs, mask=m_in, other=127).to(tl.int32))
        else:
            scale = tl.load(scale_ptr + s_offs, mask=m_in, other=1.0)
        val = tl.where(valid[:, None], e4m3_value(code) * scale, float("nan"))
        _store_rounded(dst, val, m_out, OUT_BF16, GPU)
    else:
        # Same dtype in and out: copy the bits, so no rounding question arises.
        bits = tl.load(table_ptr + src, mask=m_in, other=0)
        tl.store(dst, tl.where(valid[:, None], bits, tl.cast(nan_bits, bits.dtype)), mask=m_out)


@triton.jit
def _scatter_add_kernel(grad_ptr, ids_ptr, g_ptr, num_lookups, num_rows, row_dim,
                        BLOCK_R: tl.constexpr, BLOCK_DH: tl.constexpr):
    """grad [R, Dh] fp32 += g [L, Dh] at rows ids [L]; repeated ids add up (atomics)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rid = tl.load(ids_ptr + r, mask=r < num_lookups, other=-1)
    valid = (r < num_lookups) & (rid >= 0) & (rid < num_rows)
    c = tl.arange(0, BLOCK_DH)
    m = valid[:, None] & (c < row_dim)[None, :]
    g = tl.load(g_ptr + r[:, None] * row_dim + c[None, :], mask=m, other=0.0).to(tl.float32)
    tl.atomic_add(grad_ptr + rid[:, None] * row_dim + c[None, :], g, mask=m, sem="relaxed")


def _gather_blocks(row_dim: int) -> tuple[int, int]:
    block_dh = triton.next_power_of_2(row_dim)
    return max(1, 4096 // block_dh), block_dh  # ~4K channels per program


def gather_rows(table: torch.Tensor, row_ids: torch.Tensor, scales: torch.Tensor | None = None, *,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """table [R, Dh], row_ids [...] int64 -> rows [..., Dh] (no autograd; see `lookup`).

    bf16/fp16/fp32 tables: rows in the table dtype, bit-exact. float8_e4m3fn tables need `scales` [R, Dh / 32]
    (float8_e8m0fnu or float32) and give rows in `out_dtype` (bf16 or fp32).
    """
    if table.dim() != 2:
        raise ValueError(f"gather_rows: table must be [R, Dh], got shape {tuple(table.shape)}")
    if row_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"gather_rows: row_ids must be int64 or int32, got {row_ids.dtype}")
    num_rows, row_dim = table.shape
    fp8 = table.dtype == torch.float8_e4m3fn
    if fp8:
        if scales is None or scales.shape != (num_rows, row_dim // _SCALE_BLOCK) or row_dim % _SCALE_BLOCK:
            raise ValueError(f"gather_rows: an fp8 table needs scales [R, Dh / 32] = "
                             f"{(num_rows, row_dim // _SCALE_BLOCK)} and Dh % 32 == 0, got "
                             f"{None if scales is None else tuple(scales.shape)}, Dh={row_dim}")
        if scales.dtype not in (torch.float8_e8m0fnu, torch.float32):
            raise TypeError(f"gather_rows: scales must be float8_e8m0fnu or float32, got {scales.dtype}")
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"gather_rows: out_dtype must be bfloat16 or float32, got {out_dtype}")
        check_device("table, scales and row_ids", "gather_rows", table, scales, row_ids)
    elif table.dtype in _BITS_VIEW:
        out_dtype = table.dtype
        check_device("table and row_ids", "gather_rows", table, row_ids)
    else:
        raise TypeError(f"gather_rows: table must be bf16, fp16, fp32 or float8_e4m3fn, got {table.dtype}")
    out = torch.empty(*row_ids.shape, row_dim, dtype=out_dtype, device=table.device)
    num_lookups = row_ids.numel()
    block_r, block_dh = _gather_blocks(row_dim)
    gpu = not interpreting()
    if fp8:
        table_arg = table.view(torch.uint8)
        scale_arg = scales.view(torch.uint8) if scales.dtype == torch.float8_e8m0fnu else scales
        out_arg, nan_bits = _bits(out, gpu), 0
    else:
        table_arg, scale_arg = table.view(_BITS_VIEW[table.dtype]), table
        out_arg, nan_bits = out.view(_BITS_VIEW[table.dtype]), _NAN_BITS[table.dtype]
    if num_lookups:
        _gather_kernel[(triton.cdiv(num_lookups, block_r),)](
            table_arg, scale_arg, row_ids, out_arg, num_lookups, num_rows, row_dim, nan_bits,
            FP8=fp8, SCALE_E8M0=fp8 and scales.dtype == torch.float8_e8m0fnu,
            OUT_BF16=out_dtype == torch.bfloat16, GPU=gpu, BLOCK_R=block_r, BLOCK_DH=block_dh)
    return out


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table, row_ids, sparse_grad):
        ctx.save_for_backward(row_ids)
        ctx.table_shape, ctx.table_dtype, ctx.sparse_grad = table.shape, table.dtype, sparse_grad
        return gather_rows(table, row_ids)

    @staticmethod
    def backward(ctx, g_rows):
        (row_ids,) = ctx.saved_tensors
        num_rows, row_dim = ctx.table_shape
        ids, g_rows = row_ids.reshape(-1), g_rows.reshape(-1, row_dim).contiguous()
        if ctx.sparse_grad:
            # Row ids + row grads; repeated ids stay separate entries (uncoalesced), as F.embedding(sparse=True).
            grad = torch.sparse_coo_tensor(ids[None], g_rows.to(ctx.table_dtype), (num_rows, row_dim),
                                           check_invariants=False)
            return grad, None, None
        grad = torch.zeros(num_rows, row_dim, dtype=torch.float32, device=g_rows.device)
        block_r, block_dh = _gather_blocks(row_dim)
        if ids.numel():
            _scatter_add_kernel[(triton.cdiv(ids.numel(), block_r),)](
                grad, ids, g_rows, ids.numel(), num_rows, row_dim, BLOCK_R=block_r, BLOCK_DH=block_dh)
        return grad.to(ctx.table_dtype), None, None


def lookup(table: torch.Tensor, row_ids: torch.Tensor, scales: torch.Tensor | None = None, *,
           table_grad: str = "dense", out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Engram.lookup with the gather kernel: row_ids [...] -> rows [..., Dh]. Differentiable for float tables:
    table_grad="dense" (atomics into a dense grad, like F.embedding) or "sparse" (touched rows only)."""
    if table_grad not in ("dense", "sparse"):
        raise ValueError(f"lookup: table_grad must be 'dense' or 'sparse', got {table_grad!r}")
    if table.dtype == torch.float8_e4m3fn:  # the stored checkpoint format: read-only
        return gather_rows(table, row_ids, scales, out_dtype=out_dtype)
    return _Lookup.apply(table, row_ids.contiguous(), table_grad == "sparse")


# ------------------------------------------------------------------------------------------------------------
# Gate


@triton.jit
def _gate_fwd_kernel(s_ptr, kv_ptr, qk_ptr, dead_ptr, s_out_ptr, g_ptr, stats_ptr,
                     num_rows, dim, eps, inv_sqrt_dim,
                     N: tl.constexpr, HAS_DEAD: tl.constexpr, S_BF16: tl.constexpr, GPU: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # Inductor passes a Python float as fp64 (eager Triton as fp32): compute in fp32 either way
    eps = tl.cast(eps, tl.float32)
    inv_sqrt_dim = tl.cast(inv_sqrt_dim, tl.float32)
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # rows (token, stream)
    r_ok = r < num_rows
    tok, k = r // N, r % N
    key_row = tok * ((N + 1) * dim) + k * dim
    p = tl.zeros([BLOCK_R], dtype=tl.float32)
    hsq = tl.zeros([BLOCK_R], dtype=tl.float32)
    ksq = tl.zeros([BLOCK_R], dtype=tl.float32)
    for d0 in range(0, dim, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m2 = r_ok[:, None] & (d < dim)[None, :]
        h = tl.load(s_ptr + r[:, None] * dim + d[None, :], mask=m2, other=0.0).to(tl.float32)
        key = tl.load(kv_ptr + key_row[:, None] + d[None, :], mask=m2, other=0.0).to(tl.float32)
        qk = tl.load(qk_ptr + k[:, None] * dim + d[None, :], mask=m2, other=0.0)
        p += tl.sum(h * qk * key, axis=1)
        hsq += tl.sum(h * h, axis=1)
        ksq += tl.sum(key * key, axis=1)
    # A8: cosine-like score on a fixed scale, then a signed square root (floor 1e-6) and a sigmoid.
    dot = p * tl.rsqrt(hsq / dim + eps) * tl.rsqrt(ksq / dim + eps) * inv_sqrt_dim
    sgn = tl.where(dot > 0, 1.0, tl.where(dot < 0, -1.0, 0.0))
    g = tl.sigmoid(sgn * tl.sqrt(tl.maximum(tl.abs(dot), 1e-6)))
    if HAS_DEAD:
        g = tl.where(tl.load(dead_ptr + tok, mask=r_ok, other=0) != 0, 0.0, g)
    tl.store(g_ptr + r, g, mask=r_ok)
    tl.store(stats_ptr + r * 3, p, mask=r_ok)
    tl.store(stats_ptr + r * 3 + 1, hsq, mask=r_ok)
    tl.store(stats_ptr + r * 3 + 2, ksq, mask=r_ok)
    value_row = tok * ((N + 1) * dim) + N * dim
    for d0 in range(0, dim, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m2 = r_ok[:, None] & (d < dim)[None, :]
        h = tl.load(s_ptr + r[:, None] * dim + d[None, :], mask=m2, other=0.0).to(tl.float32)
        v = tl.load(kv_ptr + value_row[:, None] + d[None, :], mask=m2, other=0.0).to(tl.float32)
        _store_rounded(s_out_ptr + r[:, None] * dim + d[None, :], h + g[:, None] * v, m2, S_BF16, GPU)


@triton.jit
def _gate_dot_kernel(g_out_ptr, kv_ptr, gg_ptr, num_rows, dim,
                     N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """dL/dg [N * n] = <dL/dS'_k, value> per (token, stream) row."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < num_rows
    value_row = (r // N) * ((N + 1) * dim) + N * dim
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for d0 in range(0, dim, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m2 = r_ok[:, None] & (d < dim)[None, :]
        go = tl.load(g_out_ptr + r[:, None] * dim + d[None, :], mask=m2, other=0.0).to(tl.float32)
        v = tl.load(kv_ptr + value_row[:, None] + d[None, :], mask=m2, other=0.0).to(tl.float32)
        acc += tl.sum(go * v, axis=1)
    tl.store(gg_ptr + r, acc, mask=r_ok)


@triton.jit
def _gate_bwd_kernel(s_ptr, kv_ptr, qk_ptr, g_out_ptr, g_ptr, coef_ptr, g_s_ptr, g_kv_ptr, g_qk_part_ptr,
                     num_tokens, dim, tokens_per_split,
                     N: tl.constexpr, S_BF16: tl.constexpr, KV_BF16: tl.constexpr, GPU: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """coef [N * n, 3] = (dL/dP, 2 dL/d|h|^2, 2 dL/d|key|^2) per row, P = sum_d h qk key."""
    d = tl.program_id(0).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < dim
    split = tl.program_id(1)
    t_begin = split * tokens_per_split
    t_end = tl.minimum(t_begin + tokens_per_split, num_tokens)
    stream = tl.arange(0, BLOCK_N)[:, None]
    g_qk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for t0 in range(t_begin, t_end, BLOCK_T):
        tok = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        t_ok = tok < t_end
        m2 = t_ok[:, None] & d_ok[None, :]
        kv_row = tok * ((N + 1) * dim)
        g_v = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for k in tl.static_range(N):
            r = tok * N + k
            offs = r[:, None] * dim + d[None, :]
            key_offs = kv_row[:, None] + k * dim + d[None, :]
            h = tl.load(s_ptr + offs, mask=m2, other=0.0).to(tl.float32)
            key = tl.load(kv_ptr + key_offs, mask=m2, other=0.0).to(tl.float32)
            go = tl.load(g_out_ptr + offs, mask=m2, other=0.0).to(tl.float32)
            qk = tl.load(qk_ptr + k * dim + d, mask=d_ok, other=0.0)[None, :]
            a = tl.load(coef_ptr + r * 3, mask=t_ok, other=0.0)[:, None]
            b = tl.load(coef_ptr + r * 3 + 1, mask=t_ok, other=0.0)[:, None]
            c = tl.load(coef_ptr + r * 3 + 2, mask=t_ok, other=0.0)[:, None]
            g = tl.load(g_ptr + r, mask=t_ok, other=0.0)[:, None]
            _store_rounded(g_s_ptr + offs, go + a * qk * key + b * h, m2, S_BF16, GPU)
            _store_rounded(g_kv_ptr + key_offs, a * qk * h + c * key, m2, KV_BF16, GPU)
            g_v += g * go
            g_qk += tl.where(stream == k, tl.sum(a * h * key, axis=0)[None, :], 0.0)
        _store_rounded(g_kv_ptr + kv_row[:, None] + N * dim + d[None, :], g_v, m2, KV_BF16, GPU)
    part = g_qk_part_ptr + split.to(tl.int64) * N * dim
    tl.store(part + stream * dim + d[None, :], g_qk, mask=(stream < N) & d_ok[None, :])


def gate_from_stats(p: torch.Tensor, hsq: torch.Tensor, ksq: torch.Tensor, dead: torch.Tensor | None,
                    dim: int, eps: float) -> torch.Tensor:
    """The gate from its three sums, [N, n] fp32: Engram.gate's formula after its reductions (A8)."""
    dot = p * torch.rsqrt(hsq / dim + eps) * torch.rsqrt(ksq / dim + eps)
    dot = dot / math.sqrt(dim)
    g = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6)))
    return g.masked_fill(dead[:, None], 0.0) if dead is not None else g


def gate_stats_grad(p: torch.Tensor, hsq: torch.Tensor, ksq: torch.Tensor, dead: torch.Tensor | None, dim: int,
                    eps: float, g_gate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dL/d(p, hsq, ksq) of `gate_from_stats` given dL/dg, [N, n] fp32 each: its chain rule written out, as autograd
    takes it (the clamp passes gradient where |dot| >= 1e-6, sign's is 0), so the backward has no autograd call
    inside it (torch.compile traces it whole)."""
    a = torch.rsqrt(hsq / dim + eps)
    b = torch.rsqrt(ksq / dim + eps)
    dot = p * a * b / math.sqrt(dim)
    mag = dot.abs()
    g = torch.sigmoid(torch.sign(dot) * torch.sqrt(mag.clamp_min(1e-6)))
    d_u = g_gate * g * (1 - g)
    if dead is not None:
        d_u = d_u.masked_fill(dead[:, None], 0.0)
    # u = sign(dot) sqrt(max(|dot|, 1e-6)): du/ddot = sign(dot)^2 / (2 sqrt(|dot|)) where |dot| >= 1e-6, else 0
    d_dot = torch.where(mag >= 1e-6, d_u * torch.sign(dot).square() * 0.5 * torch.rsqrt(mag.clamp_min(1e-6)), 0.0)
    d_dot = d_dot / math.sqrt(dim)  # dot = p a b / sqrt(dim)
    # d rsqrt(x / dim + eps) / dx = -rsqrt(...)^3 / (2 dim)
    return d_dot * a * b, d_dot * p * b * (-0.5 / dim) * a ** 3, d_dot * p * a * (-0.5 / dim) * b ** 3


def _check_gate(S, kv, qk, dead, fn_name):
    if S.dim() != 3:
        raise ValueError(f"{fn_name}: S must be [N, n, D], got shape {tuple(S.shape)}")
    N, n, D = S.shape
    if kv.shape != (N, (n + 1) * D):
        raise ValueError(f"{fn_name}: kv must be [N, (n+1)*D] = {(N, (n + 1) * D)}, got {tuple(kv.shape)}")
    if qk.shape != (n, D) or qk.dtype != torch.float32:
        raise ValueError(f"{fn_name}: qk must be float32 [n, D] = {(n, D)}, got {qk.dtype} {tuple(qk.shape)}")
    for name, t in (("S", S), ("kv", kv)):
        if t.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"{fn_name}: {name} must be bfloat16 or float32, got {t.dtype}")
    tensors = [S, kv, qk]
    if dead is not None:
        if dead.shape != (N,) or dead.dtype != torch.bool:
            raise ValueError(f"{fn_name}: dead must be bool [N] = {(N,)}, got {dead.dtype} {tuple(dead.shape)}")
        tensors.append(dead)
    check_device("S, kv, qk and dead", fn_name, *tensors)
    return N, n, D


def gate_fwd(S: torch.Tensor, kv: torch.Tensor, qk: torch.Tensor, dead: torch.Tensor | None, eps: float, *,
             block_r: int | None = None, block_d: int | None = None, num_warps: int = 8
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused gate + update (no autograd): -> (S' [N, n, D], g [N, n] fp32, sums [N, n, 3] fp32 = (P, |h|^2,
    |key|^2) with P = sum_d h * qk * key, kept for the backward)."""
    N, n, D = _check_gate(S, kv, qk, dead, "gate_fwd")
    s_out = torch.empty_like(S)
    g = torch.empty(N, n, dtype=torch.float32, device=S.device)
    sums = torch.empty(N, n, 3, dtype=torch.float32, device=S.device)
    # One token's n rows per program and wide D tiles (H200 sweep: bench/kernel_cases/engram.py); pass 2
    # re-reads the rows this program just read, from L2.
    block_r = block_r or triton.next_power_of_2(n)
    block_d = block_d or min(1024, triton.next_power_of_2(D))
    gpu = not interpreting()
    if N:
        _gate_fwd_kernel[(triton.cdiv(N * n, block_r),)](
            S, kv, qk, dead if dead is not None else S, _bits(s_out, gpu), g, sums,  # bool: Triton reads it as i1
            N * n, D, eps, 1.0 / math.sqrt(D), N=n, HAS_DEAD=dead is not None,
            S_BF16=S.dtype == torch.bfloat16, GPU=gpu, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=num_warps)
    return s_out, g, sums


def gate_bwd(S: torch.Tensor, kv: torch.Tensor, qk: torch.Tensor, dead: torch.Tensor | None, eps: float,
             g: torch.Tensor, sums: torch.Tensor, g_out: torch.Tensor, *, block_t: int = 8, block_d: int = 128
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `gate_fwd` given dL/dS' [N, n, D]: (dL/dS, dL/dkv [N, (n+1)*D], dL/dqk [n, D] fp32)."""
    N, n, D = _check_gate(S, kv, qk, dead, "gate_bwd")
    if g_out.shape != S.shape:
        raise ValueError(f"gate_bwd: g_out must have S's shape {tuple(S.shape)}, got {tuple(g_out.shape)}")
    g_out = g_out.contiguous()
    gpu = not interpreting()
    gg = torch.empty(N, n, dtype=torch.float32, device=S.device)
    if N:
        block_r = triton.next_power_of_2(4 * n)
        _gate_dot_kernel[(triton.cdiv(N * n, block_r),)](g_out, kv, gg, N * n, D, N=n, BLOCK_R=block_r, BLOCK_D=256)
    g_p, g_hsq, g_ksq = gate_stats_grad(*sums.unbind(-1), dead, D, eps, gg)
    coef = torch.stack([g_p, 2.0 * g_hsq, 2.0 * g_ksq], dim=-1).contiguous()  # [N, n, 3]
    g_s, g_kv = torch.empty_like(S), torch.empty_like(kv)
    # Split-K over tokens for dL/dqk: enough splits to fill the GPU, few enough that the partials are small.
    splits = max(1, min(16, triton.cdiv(N, 512)))
    part = torch.empty(splits, n, D, dtype=torch.float32, device=S.device)
    if N:
        _gate_bwd_kernel[(triton.cdiv(D, block_d), splits)](
            S, kv, qk, g_out, g, coef, _bits(g_s, gpu), _bits(g_kv, gpu), part, N, D, triton.cdiv(N, splits),
            N=n, S_BF16=S.dtype == torch.bfloat16, KV_BF16=kv.dtype == torch.bfloat16, GPU=gpu,
            BLOCK_T=block_t, BLOCK_D=block_d, BLOCK_N=triton.next_power_of_2(n))
    return g_s, g_kv, part.sum(0)


class _Gate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, S, kv, qk, dead, eps, fwd_kwargs):
        s_out, g, sums = gate_fwd(S, kv, qk, dead, eps, **fwd_kwargs)
        ctx.save_for_backward(S, kv, qk, dead, g, sums)
        ctx.eps = eps
        return s_out

    @staticmethod
    def backward(ctx, g_out):
        S, kv, qk, dead, g, sums = ctx.saved_tensors
        g_s, g_kv, g_qk = gate_bwd(S, kv, qk, dead, ctx.eps, g, sums, g_out)
        return g_s, g_kv, g_qk, None, None, None


def gate_update(S: torch.Tensor, kv: torch.Tensor, qk: torch.Tensor, dead: torch.Tensor | None, eps: float,
                **fwd_kwargs) -> torch.Tensor:
    """Fused Engram gate + update: S [N, n, D], kv [N, (n+1)*D], qk = q_weight * k_weight [n, D] fp32,
    dead [N] bool or None -> S' [N, n, D] (S's dtype). Differentiable in S, kv and qk."""
    return _Gate.apply(S.contiguous(), kv.contiguous(), qk.contiguous(),
                       dead.contiguous() if dead is not None else None, eps, fwd_kwargs)

