"""Manifold-constrained hyper-connections (mHC), single pass (SPEC 1.6, REFERENCE A6).

Contract: the residual stream is n parallel streams S [B, T, n, D]. Every sub-block (attention, FFN) is a site
(`HCSite`) that predicts, per token, fp32 coefficients (`Coeffs`): pre [n] (collapse: x = sum_k pre_k S_k), post
[n] (write-back of the output y) and a doubly-stochastic comb [n, n] (`sinkhorn`); out_k = post_k y +
sum_j comb[j, k] S_j. A site's `pre` is used by the next site (the lag), so expand, next-site prediction and
collapse fuse into one pass: `mhc_step(impl, ...)` with impl "single_pass" or "unfused" (the same function).
Helpers: `init_streams`, `first_pre`, `enter`, `collapse`, `expand`, `mix_matrix`. Coefficient arithmetic is fp32
whatever the stream dtype; site parameters stay fp32 in a bf16 model (do not cast the model wholesale); streams
are stored in the activation dtype.

Design and reasoning: docs/model.md#manifold-constrained-hyper-connections
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from model.common import full_precision, init_normal
from model.config import MHCConfig


class Coeffs(NamedTuple):
    """One site's coefficients for every token, all fp32."""

    pre: torch.Tensor  # [B, T, n]  > 0 (sigmoid + eps)
    post: torch.Tensor  # [B, T, n] in (0, 2)
    comb: torch.Tensor  # [B, T, n, n] comb[j, k]: weight of input stream j in output stream k


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., n, n] logits (rows j, columns k) -> doubly-stochastic fp32 matrix, A6 steps 6-8.

    softmax over k, + eps; then `iters` column normalisations with a row normalisation before each one but the
    first, so the last step is a column normalisation (every output stream is a convex-like mix of inputs).
    The eps in each denominator keeps an all-tiny column finite; it also leaves sums ~eps short of 1.
    """
    c = torch.softmax(logits.float(), dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


class HCSite(nn.Module):
    """Coefficient predictor of one site (attention or FFN): S [B, T, n, D] -> Coeffs.

    Parameters (fp32): fn [M, n*D] projects the RMS-normalised flattened streams (stream-major: index k*D + d)
    to M logits; base [M] and scale [3] (one scale per group pre / post / comb) shape them (A6 steps 1-5).
    """

    def __init__(self, dim: int, cfg: MHCConfig, norm_eps: float):
        super().__init__()
        n = cfg.num_streams
        self.dim = dim
        self.num_streams = n
        self.sinkhorn_iters = cfg.sinkhorn_iters
        self.eps = cfg.eps
        self.norm_eps = norm_eps  # the unweighted RMS of u: 1e-20 in the reference
        num_logits = 2 * n + n * n
        # fp32 regardless of the model dtype: sigmoid/Sinkhorn inputs are precision sensitive (A11 "kept fp32")
        self.fn = nn.Parameter(torch.empty(num_logits, n * dim, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(num_logits, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def init_weights(self, init_std: float) -> None:
        # A6 "Init": fn ~ N(0, init_std), base = 0, scale = 1. With base = 0 a fresh site starts at pre ~ 0.5,
        # post ~ 1 and a near-uniform comb.
        init_normal(self.fn, init_std)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_streams={self.num_streams}, sinkhorn_iters={self.sinkhorn_iters}"

    def project(self, S: torch.Tensor, rms_last: bool = False) -> torch.Tensor:
        """A6 steps 1-2: S [B, T, n, D] -> raw logits m [B, T, M] = fn . (u / rms(u)), u = flatten(S) in fp32.

        rms_last: project the un-normalised u and apply the 1/rms factor afterwards, the order in which the fused
        kernel accumulates it (`single_pass`); the same function up to rounding."""
        with full_precision(S.device.type):
            u = S.float().flatten(-2)  # [B, T, n*D]
            if rms_last:
                sum_sq = u.square().sum(dim=-1, keepdim=True)  # [B, T, 1]
                return F.linear(u, self.fn.float()) * torch.rsqrt(sum_sq / u.shape[-1] + self.norm_eps)
            u = u * torch.rsqrt(u.square().mean(dim=-1, keepdim=True) + self.norm_eps)
            return F.linear(u, self.fn.float())

    def coeffs_from_logits(self, m: torch.Tensor) -> Coeffs:
        """A6 steps 3-8: raw logits m [B, T, M] (fp32) -> Coeffs."""
        n = self.num_streams
        scale, base = self.scale.float(), self.base.float()
        pre = torch.sigmoid(m[..., :n] * scale[0] + base[:n]) + self.eps
        post = 2.0 * torch.sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])  # no eps (A6 step 4)
        comb_logits = m[..., 2 * n:] * scale[2] + base[2 * n:]
        comb_logits = comb_logits.unflatten(-1, (n, n))  # row-major: [..., j, k]
        return Coeffs(pre, post, sinkhorn(comb_logits, self.sinkhorn_iters, self.eps))

    def forward(self, S: torch.Tensor, rms_last: bool = False) -> Coeffs:
        # The site's parameters are read only inside its own call (single_pass too), so a parallel plan can wrap it.
        return self.coeffs_from_logits(self.project(S, rms_last))


# ---------------------------------------------------------------------------------------------------------------
# Pure stream operations (the unfused building blocks)


def mix_streams(A: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """out [..., m, D] = sum_j A[..., m, j] S[..., j, D] in fp32, per token (A fp32 [..., m, n], S [..., n, D]).

    The contraction is over the n streams (n = 4): a GEMM with K = n is misaligned on tensor cores and runs as a
    slow fp32 FFMA kernel. Eager runs it as that one batched matmul (one launch; n broadcast multiply-adds would
    be 2n - 1 passes over S); under torch.compile it is written as a broadcast product summed over j, which
    Inductor fuses into one pass over S with the sum in registers (no GEMM, no [..., m, n, D] temporary), and the
    backward likewise. Autocast is off either way (a bf16 autocast would round the fp32 mix).
    """
    with full_precision(S.device.type):
        if torch.compiler.is_compiling():
            return (A.unsqueeze(-1) * S.float().unsqueeze(-3)).sum(-2)
        return torch.matmul(A, S.float())


def init_streams(h: torch.Tensor, num_streams: int) -> torch.Tensor:
    """h [B, T, D] -> S [B, T, n, D] with every stream equal to h (A6 "Streams"); contiguous for the kernels."""
    return h.unsqueeze(-2).expand(*h.shape[:-1], num_streams, h.shape[-1]).contiguous()


def first_pre(num_streams: int, batch_shape: tuple[int, ...] = (), device: torch.device | str | None = None
              ) -> torch.Tensor:
    """The pre_prev of the very first site: one-hot on stream 0, fp32, [*batch_shape, n] (broadcasts)."""
    pre = torch.zeros(*batch_shape, num_streams, dtype=torch.float32, device=device)
    pre.narrow(-1, 0, 1).fill_(1.0)  # (a fill, not an indexed assignment: no host-to-device copy in a CUDA graph)
    return pre


def collapse(S: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x [B, T, D] = sum_k pre_k S_k, in fp32, cast to S.dtype. pre [B, T, n] (or anything broadcasting)."""
    x = mix_streams(pre.float().unsqueeze(-2), S)  # [B, T, 1, D]
    return x.squeeze(-2).to(S.dtype)


def expand(y: torch.Tensor, S: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """S' [B, T, n, D]: S'_k = post_k y + sum_j comb[j, k] S_j, in fp32, cast to S.dtype. y [B, T, D]."""
    mixed = mix_streams(comb.float().transpose(-1, -2), S)  # [B, T, n(k), D]
    out = post.float().unsqueeze(-1) * y.float().unsqueeze(-2) + mixed
    return out.to(S.dtype)


def enter(S: torch.Tensor, pre_lag: torch.Tensor, site: HCSite) -> tuple[torch.Tensor, Coeffs]:
    """A site with no expand before it (the first site, or the one after an engram): (x, site's coeffs).

    x = collapse(S, pre_lag) and site(S) read the same S; the fused kernel does both in one pass.
    """
    return collapse(S, pre_lag), site(S)


# ---------------------------------------------------------------------------------------------------------------
# The step between two sites: expand site i, predict site i+1, collapse site i+1's input with site i's pre.


def unfused_step(y: torch.Tensor, S: torch.Tensor, coeffs: Coeffs, pre_lag: torch.Tensor,
                 next_site: HCSite | None) -> tuple[torch.Tensor, torch.Tensor, Coeffs | None]:
    """The literal A6 sequence: expand, then the next site's coefficients, then collapse (3 passes over S).

    Returns (S_new [B, T, n, D], x [B, T, D], next_coeffs or None when there is no next site).
    """
    S_new = expand(y, S, coeffs.post, coeffs.comb)
    next_coeffs = next_site(S_new) if next_site is not None else None
    return S_new, collapse(S_new, pre_lag), next_coeffs


def mix_matrix(pre_lag: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Per-token fp32 matrix W [B, T, n+1, n+1] mapping inputs (y, S_0..S_{n-1}) to outputs (S'_0..S'_{n-1}, x).

    Rows 0..n-1 are expand: W[k, 0] = post_k, W[k, 1+j] = comb[j, k]. Row n is the lagged collapse of S',
    folded through expand by linearity: x = (sum_k pre_k post_k) y + sum_j (sum_k comb[j, k] pre_k) S_j, so x
    needs no second read of S'. This tiny matrix is all the fused kernel needs besides the activations.
    """
    pre_lag, post, comb = pre_lag.float(), post.float(), comb.float()
    pre_lag = pre_lag.expand_as(post)  # first_pre may come without batch dims
    x_from_y = (pre_lag * post).sum(dim=-1, keepdim=True)  # [B, T, 1]
    x_from_s = (comb * pre_lag.unsqueeze(-2)).sum(-1)  # [B, T, n(j)]: sum_k comb[j, k] pre_k (a K = n GEMM otherwise)
    top = torch.cat([post.unsqueeze(-1), comb.transpose(-1, -2)], dim=-1)  # [B, T, n(k), 1 + n(j)]
    bottom = torch.cat([x_from_y, x_from_s], dim=-1).unsqueeze(-2)  # [B, T, 1, 1 + n]
    return torch.cat([top, bottom], dim=-2)


def single_pass(y: torch.Tensor, S: torch.Tensor, coeffs: Coeffs, pre_lag: torch.Tensor,
                next_site: HCSite | None) -> tuple[torch.Tensor, torch.Tensor, Coeffs | None]:
    """Same function as `unfused_step`, written as the fused kernel computes it (its PyTorch reference).

    One pass over y and the n streams, tile by tile along D: per token, out = W (y, S_0..S_{n-1}) gives the n
    new streams and x together (`mix_matrix`); the new streams are rounded to the stream dtype (they must be
    stored anyway) and, still in registers, feed two accumulators for the next site: sum of squares and the
    raw projection fn . flatten(S') (linear in S', so it accumulates across D tiles; the 1/rms factor is
    applied once at the end). Only the M logits per token and the tiny Sinkhorn run after the pass.

    Numerics vs `unfused_step`: the next coefficients are computed from the rounded (stored) streams, exactly
    what the unfused path reads back; x comes from unrounded fp32 values, so in bf16 it differs from the unfused
    x by at most the rounding of S' (it is the more accurate of the two). In fp32 both agree to rounding.
    """
    n = S.shape[-2]
    with full_precision(S.device.type):
        W = mix_matrix(pre_lag, coeffs.post, coeffs.comb)  # [B, T, n+1, n+1]
        out = W[..., :1] * y.float().unsqueeze(-2) + mix_streams(W[..., 1:], S)  # [B, T, n+1, D]
        S_new = out[..., :n, :].to(S.dtype)
        x = out[..., n, :].to(S.dtype)
    if next_site is None:
        return S_new, x, None
    # The next site reads the stored (rounded) streams, re-read from registers in the kernel, with the 1/rms factor
    # applied after the projection as the kernel's accumulators do.
    return S_new, x, next_site(S_new, rms_last=True)


_STEPS = {"single_pass": single_pass, "unfused": unfused_step}


def mhc_step(impl: str, y: torch.Tensor, S: torch.Tensor, coeffs: Coeffs, pre_lag: torch.Tensor,
             next_site: HCSite | None) -> tuple[torch.Tensor, torch.Tensor, Coeffs | None]:
    """Dispatch on MHCConfig.impl ("single_pass" | "unfused"); both return (S_new, x, next_coeffs). The reference
    path: model.kernels.mhc_step takes the kernel switch, and runs the fused Triton step on "triton"."""
    try:
        step = _STEPS[impl]
    except KeyError:
        raise ValueError(f"model.mhc.impl must be one of {sorted(_STEPS)}, got {impl!r}") from None
    return step(y, S, coeffs, pre_lag, next_site)
