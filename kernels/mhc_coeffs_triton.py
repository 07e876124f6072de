"""Triton kernels for the next mHC site's coefficients from the fused step's statistics (SPEC 1.6, REFERENCE A6
steps 2-8), one launch each way; model.kernels.mhc_single_pass calls `next_coeffs` after
kernels.mhc_triton.mhc_step.

Contract: `next_coeffs(raw, sumsq, scale, base, dim=, norm_eps=, eps=, sinkhorn_iters=)` -> (pre [N, n], post
[N, n], comb [N, n, n]) fp32, what `model.mhc.HCSite.coeffs_from_logits(raw * rsqrt(sumsq / (n D) + norm_eps))`
computes (some 100 small PyTorch kernels, most of them the Sinkhorn iterations), differentiable in raw, sumsq, scale
and base. Shape legend: N tokens, n streams, M = 2n + n^2 logits per token (pre, post, comb).

Design and reasoning: docs/kernels.md#mhc-coefficient-kernels
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import check_device

__all__ = ["next_coeffs"]

_BLOCK_T = 64


# ------------------------------------------------------------------------------------------------------------
# Device helpers


@triton.jit
def _load_groups(ptr, tile, N: tl.constexpr):
    """Rows [*, M] of this program's tokens as their groups: (pre [BLOCK_T, NP], post, comb [BLOCK_T, NP, NP])."""
    tok, _, k, jk, _, m2, m3 = tile
    M: tl.constexpr = 2 * N + N * N
    return (tl.load(ptr + tok[:, None] * M + k[None, :], mask=m2, other=0.0),
            tl.load(ptr + tok[:, None] * M + N + k[None, :], mask=m2, other=0.0),
            tl.load(ptr + tok[:, None, None] * M + 2 * N + jk[None, :, :], mask=m3, other=0.0))


@triton.jit
def _store_groups(ptr, tile, pre, post, comb, N: tl.constexpr):
    """The inverse of `_load_groups`: the three groups into rows [*, M]."""
    tok, _, k, jk, _, m2, m3 = tile
    M: tl.constexpr = 2 * N + N * N
    tl.store(ptr + tok[:, None] * M + k[None, :], pre, mask=m2)
    tl.store(ptr + tok[:, None] * M + N + k[None, :], post, mask=m2)
    tl.store(ptr + tok[:, None, None] * M + 2 * N + jk[None, :, :], comb, mask=m3)


@triton.jit
def _coeff_prologue(raw_ptr, sumsq_ptr, scale_ptr, base_ptr, num_tokens, inv_width, norm_eps,
                    N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr):
    """What both directions start from, for this program's BLOCK_T tokens: (tile, r, raw, z, scale) with
    tile  = (tok [BLOCK_T], t_ok, k [NP], jk [NP, NP] = j * n + k, valid [1, NP, NP], m2 [BLOCK_T, NP] (pre,
            post), m3 [BLOCK_T, NP, NP] (comb)): the indices and masks of the groups,
    r     = the per-token rms factor [BLOCK_T],
    raw   = the raw logits by group (`_load_groups`), z = their pre-activations raw * r * scale + base,
    scale = (s0, s1, s2)."""
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tok < num_tokens
    k = tl.arange(0, NP)
    k_ok = k < N
    jk = k[:, None] * N + k[None, :]
    valid2 = k_ok[:, None] & k_ok[None, :]  # [NP, NP]
    valid = valid2[None, :, :]
    tile = (tok, t_ok, k, jk, valid, t_ok[:, None] & k_ok[None, :], t_ok[:, None, None] & valid)
    r = tl.math.rsqrt(tl.load(sumsq_ptr + tok, mask=t_ok, other=1.0) * inv_width + norm_eps)
    raw_pre, raw_post, raw_comb = _load_groups(raw_ptr, tile, N)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    z_pre = raw_pre * r[:, None] * s0 + tl.load(base_ptr + k, mask=k_ok, other=0.0)[None, :]
    z_post = raw_post * r[:, None] * s1 + tl.load(base_ptr + N + k, mask=k_ok, other=0.0)[None, :]
    z_comb = raw_comb * r[:, None, None] * s2 + tl.load(base_ptr + 2 * N + jk, mask=valid2, other=0.0)[None, :, :]
    return tile, r, (raw_pre, raw_post, raw_comb), (z_pre, z_post, z_comb), (s0, s1, s2)


@triton.jit
def _softmax_eps(z, valid, eps):
    """softmax over k (axis 2) + eps on the valid entries: (c0, p)."""
    z = tl.where(valid, z, float("-inf"))
    e = tl.exp(z - tl.max(z, axis=2)[:, :, None])
    e = tl.where(valid, e, 0.0)
    p = e / tl.sum(e, axis=2)[:, :, None]
    p = tl.where(valid, p, 0.0)
    return tl.where(valid, p + eps, 0.0), p


@triton.jit
def _sinkhorn_step(c, t, valid, eps):
    """Normalisation t >= 1 of the Sinkhorn sequence: columns (sum over j, axis 1) when t is odd, else rows.
    Returns (c / (s + eps), s + eps) with s broadcast to c's shape; padding stays 0."""
    col = tl.sum(c, axis=1)[:, None, :]
    row = tl.sum(c, axis=2)[:, :, None]
    den = tl.where(t % 2 == 1, col, row) + eps
    return tl.where(valid, c / den, 0.0), den


# ------------------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _coeff_fwd_kernel(raw_ptr, sumsq_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr,
                      num_tokens, inv_width, norm_eps, eps, iters,
                      N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr):
    # Inductor passes a Python float as fp64 (eager Triton as fp32): compute in fp32 either way
    inv_width = tl.cast(inv_width, tl.float32)
    norm_eps = tl.cast(norm_eps, tl.float32)
    eps = tl.cast(eps, tl.float32)
    tile, _, _, z, _ = _coeff_prologue(raw_ptr, sumsq_ptr, scale_ptr, base_ptr, num_tokens, inv_width, norm_eps,
                                       N, NP, BLOCK_T)
    tok, _, k, jk, valid, m2, m3 = tile
    z_pre, z_post, z_comb = z
    tl.store(pre_ptr + tok[:, None] * N + k[None, :], tl.sigmoid(z_pre) + eps, mask=m2)
    tl.store(post_ptr + tok[:, None] * N + k[None, :], 2.0 * tl.sigmoid(z_post), mask=m2)
    c, _ = _softmax_eps(z_comb, valid, eps)
    for t in range(1, 2 * iters):
        c, _ = _sinkhorn_step(c, t, valid, eps)
    tl.store(comb_ptr + tok[:, None, None] * (N * N) + jk[None, :, :], c, mask=m3)


@triton.jit
def _coeff_bwd_kernel(raw_ptr, sumsq_ptr, scale_ptr, base_ptr, g_pre_ptr, g_post_ptr, g_comb_ptr,
                      g_raw_ptr, g_sumsq_ptr, g_scale_ptr, g_base_ptr,
                      num_tokens, inv_width, norm_eps, eps, iters,
                      N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr):
    """Per token: g_raw [M], g_sumsq; and the token's terms of g_scale [3] and g_base [M] (summed on the host)."""
    # Inductor passes a Python float as fp64 (eager Triton as fp32): compute in fp32 either way
    inv_width = tl.cast(inv_width, tl.float32)
    norm_eps = tl.cast(norm_eps, tl.float32)
    eps = tl.cast(eps, tl.float32)
    tile, r, raw, z, scale = _coeff_prologue(raw_ptr, sumsq_ptr, scale_ptr, base_ptr, num_tokens, inv_width,
                                             norm_eps, N, NP, BLOCK_T)
    tok, t_ok, k, jk, valid, m2, m3 = tile
    raw_pre, raw_post, raw_comb = raw
    z_pre, z_post, z_comb = z
    s0, s1, s2 = scale
    sg = tl.sigmoid(z_pre)
    gz_pre = tl.load(g_pre_ptr + tok[:, None] * N + k[None, :], mask=m2, other=0.0) * sg * (1.0 - sg)
    sg = tl.sigmoid(z_post)
    gz_post = tl.load(g_post_ptr + tok[:, None] * N + k[None, :], mask=m2, other=0.0) * 2.0 * sg * (1.0 - sg)
    # Sinkhorn backward, last step first: c_t = c_{t-1} / den  =>  g_{t-1} = (g_t - sum_axis(g_t c_t)) / den.
    c0, p = _softmax_eps(z_comb, valid, eps)
    g = tl.load(g_comb_ptr + tok[:, None, None] * (N * N) + jk[None, :, :], mask=m3, other=0.0)
    for i in range(0, 2 * iters - 1):
        t = 2 * iters - 1 - i
        c = c0
        for u in range(1, t):
            c, _ = _sinkhorn_step(c, u, valid, eps)
        c, den = _sinkhorn_step(c, t, valid, eps)
        gc = g * c
        g_sum = tl.where(t % 2 == 1, tl.sum(gc, axis=1)[:, None, :], tl.sum(gc, axis=2)[:, :, None])
        g = tl.where(valid, (g - g_sum) / den, 0.0)
    gz_comb = p * (g - tl.sum(g * p, axis=2)[:, :, None])  # softmax backward (the + eps is constant)
    # z = raw * r * scale + base; dL/d(r * scale_i) per token and group:
    g_rs0 = tl.sum(gz_pre * raw_pre, axis=1)
    g_rs1 = tl.sum(gz_post * raw_post, axis=1)
    g_rs2 = tl.sum(tl.sum(gz_comb * raw_comb, axis=2), axis=1)
    g_r = g_rs0 * s0 + g_rs1 * s1 + g_rs2 * s2  # dL/dr [BLOCK_T]
    _store_groups(g_raw_ptr, tile, gz_pre * (r * s0)[:, None], gz_post * (r * s1)[:, None],
                  gz_comb * (r * s2)[:, None, None], N)
    _store_groups(g_base_ptr, tile, gz_pre, gz_post, gz_comb, N)
    tl.store(g_sumsq_ptr + tok, g_r * (-0.5 * inv_width) * r * r * r, mask=t_ok)
    tl.store(g_scale_ptr + tok * 3, g_rs0 * r, mask=t_ok)
    tl.store(g_scale_ptr + tok * 3 + 1, g_rs1 * r, mask=t_ok)
    tl.store(g_scale_ptr + tok * 3 + 2, g_rs2 * r, mask=t_ok)


# ------------------------------------------------------------------------------------------------------------
# Host wrappers


class _Coeffs(torch.autograd.Function):
    """(raw [N, M], sum_sq [N], scale [3], base [M]) -> (pre [N, n], post [N, n], comb [N, n, n]), fp32."""

    @staticmethod
    def forward(ctx, raw, sumsq, scale, base, n, width, norm_eps, eps, iters):
        N = raw.shape[0]
        pre = torch.empty(N, n, dtype=torch.float32, device=raw.device)
        post = torch.empty_like(pre)
        comb = torch.empty(N, n, n, dtype=torch.float32, device=raw.device)
        if N:
            _coeff_fwd_kernel[(triton.cdiv(N, _BLOCK_T),)](
                raw, sumsq, scale, base, pre, post, comb, N, 1.0 / width, norm_eps, eps, iters,
                N=n, NP=triton.next_power_of_2(n), BLOCK_T=_BLOCK_T, num_warps=4)
        ctx.save_for_backward(raw, sumsq, scale, base)
        ctx.consts = (n, width, norm_eps, eps, iters)
        return pre, post, comb

    @staticmethod
    def backward(ctx, g_pre, g_post, g_comb):
        raw, sumsq, scale, base = ctx.saved_tensors
        n, width, norm_eps, eps, iters = ctx.consts
        N, M = raw.shape
        z = raw.new_zeros(())
        g_pre = z.expand(N, n) if g_pre is None else g_pre
        g_post = z.expand(N, n) if g_post is None else g_post
        g_comb = z.expand(N, n, n) if g_comb is None else g_comb
        g_pre, g_post, g_comb = (g.float().contiguous() for g in (g_pre, g_post, g_comb))
        g_raw = torch.empty_like(raw)
        g_sumsq = torch.empty_like(sumsq)
        g_scale = torch.empty(N, 3, dtype=torch.float32, device=raw.device)
        g_base = torch.empty(N, M, dtype=torch.float32, device=raw.device)
        if N:
            _coeff_bwd_kernel[(triton.cdiv(N, _BLOCK_T),)](
                raw, sumsq, scale, base, g_pre, g_post, g_comb, g_raw, g_sumsq, g_scale, g_base,
                N, 1.0 / width, norm_eps, eps, iters,
                N=n, NP=triton.next_power_of_2(n), BLOCK_T=_BLOCK_T, num_warps=4)
        return g_raw, g_sumsq, g_scale.sum(0), g_base.sum(0), None, None, None, None, None


def next_coeffs(raw: torch.Tensor, sumsq: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *, dim: int,
                norm_eps: float, eps: float, sinkhorn_iters: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A site's coefficients from the fused step's statistics, raw [N, M] and sum_sq [N] fp32, in one kernel each
    way: (pre [N, n], post [N, n], comb [N, n, n]) fp32, the same function as
    `site.coeffs_from_logits(raw * rsqrt(sum_sq / (n D) + norm_eps))` of a model.mhc.HCSite whose parameters are
    scale [3] and base [M] (M = 2n + n^2) and whose settings are dim (D), norm_eps, eps and sinkhorn_iters.
    Differentiable in raw, sum_sq, scale and base."""
    M = base.shape[0] if base.dim() == 1 else -1
    n = int(round((M + 1) ** 0.5)) - 1 if M > 0 else 0
    if base.dim() != 1 or M != 2 * n + n * n or n < 1 or scale.shape != (3,):
        raise ValueError(f"next_coeffs: base must be [2n + n^2] and scale [3], got {tuple(base.shape)}, "
                         f"{tuple(scale.shape)}")
    if raw.shape != (raw.shape[0], M) or sumsq.shape != raw.shape[:1]:
        raise ValueError(f"next_coeffs: raw must be [N, {M}] and sum_sq [N], got {tuple(raw.shape)}, "
                         f"{tuple(sumsq.shape)}")
    scale, base = scale.float().contiguous(), base.float().contiguous()
    check_device("raw, sum_sq and the site's parameters", "next_coeffs", raw, sumsq, scale, base)
    return _Coeffs.apply(raw.float().contiguous(), sumsq.float().contiguous(), scale, base, n, n * dim, norm_eps,
                         eps, sinkhorn_iters)
