"""Muon: momentum orthogonalised by a Newton-Schulz iteration, for weight matrices (SPEC 1.7).

Contract: `orthogonalise(updates, head_rows, rms)` replaces each matrix update by an approximation of the orthogonal
polar factor of its Nesterov momentum (`newton_schulz`: the report's hybrid schedule, 8 fast steps then 2 converging
ones, in bf16 on a GPU (`ns_dtype`) and fp32 on the CPU), block by block (`blocks`: a plain matrix is one block,
stacked experts one per expert, head-wise parameters one per head; blocks of one shape run as one batch), rescaled
to RMS `rms` whatever the shape (0.2: AdamW's learning rate and weight decay carry over).

Design and reasoning: docs/optim.md#muon
"""

from __future__ import annotations

import torch

NS_SCHEDULE: tuple[tuple[float, float, float], ...] = ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2
"""the report's hybrid Newton-Schulz schedule: (a, b, c) per step"""

RMS = 0.2
"""the update's RMS per block: AdamW's typical update RMS, so its learning rates carry over"""


def ns_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU, fp32 elsewhere (the CPU's bf16 matmuls are slow and no more accurate)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def newton_schulz(g: torch.Tensor, schedule=NS_SCHEDULE, eps: float = 1e-7) -> torch.Tensor:
    """g [..., m, n] -> its orthogonal polar factor, approximately (singular values near 1), same shape, in
    `ns_dtype` (bf16 on a GPU, fp32 on the CPU).

    Each trailing matrix is normalised by its Frobenius norm first (an upper bound of the spectral norm, so every
    singular value starts in (0, 1], where the polynomials converge); the iteration runs on the wide orientation
    (m <= n), whose Gram matrix X X^T is the smaller one. Each step is two batched GEMMs with their sums in the
    GEMM (baddbmm): b A + c A A, then a X + (b A + c A A) X, with no elementwise pass over X."""
    shape = g.shape
    x = g.reshape(-1, *shape[-2:]).to(ns_dtype(g.device))
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for a, b, c in schedule:
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a, alpha=1.0)
    if tall:
        x = x.mT
    return x.reshape(shape)


def block_shape(shape, head_rows: int | None) -> tuple[int, int, int]:
    """(N, m, n): a parameter of `shape` as Muon's batch of N blocks [m, n]."""
    shape = tuple(shape)
    if head_rows is not None:
        if len(shape) != 2 or shape[0] % head_rows:
            raise ValueError(f"head-wise Muon: a [H * {head_rows}, n] matrix, got shape {shape}")
        return shape[0] // head_rows, head_rows, shape[1]
    if len(shape) == 2:
        return (1, *shape)
    if len(shape) == 3:
        return shape
    raise ValueError(f"Muon takes matrices ([m, n]) or stacked matrices ([E, m, n]), got shape {shape}")


def blocks(t: torch.Tensor, head_rows: int | None) -> torch.Tensor:
    """The parameter-shaped tensor t as its batch of Muon blocks [N, m, n] (a view)."""
    return t.view(block_shape(t.shape, head_rows))


def orthogonal_factors(updates: list[torch.Tensor], head_rows: list[int | None], rms: float = RMS
                       ) -> list[tuple[torch.Tensor, float]]:
    """Per momentum tensor (parameter-shaped): (its blocks' orthogonal factors, parameter-shaped, in `ns_dtype`;
    the scale that gives them RMS `rms`), for the caller to apply as one fused multiply-add. Blocks of one shape
    and device are stacked into one batched iteration."""
    views = [blocks(u, r) for u, r in zip(updates, head_rows)]
    by_shape: dict[tuple, list[int]] = {}
    for i, v in enumerate(views):
        by_shape.setdefault((tuple(v.shape[1:]), v.device), []).append(i)
    out: list = [None] * len(views)
    for (shape, _), idx in by_shape.items():
        batch = torch.cat([views[i] for i in idx]) if len(idx) > 1 else views[idx[0]]
        o = newton_schulz(batch)
        for i, part in zip(idx, o.split([views[i].shape[0] for i in idx])):
            out[i] = (part.reshape(updates[i].shape), rms * max(shape) ** 0.5)
    return out


def orthogonalise(updates: list[torch.Tensor], head_rows: list[int | None], rms: float = RMS) -> list[torch.Tensor]:
    """The Muon update of each momentum tensor (parameter-shaped): blocks orthogonalised, scaled to RMS `rms`, fp32."""
    return [o.float() * scale for o, scale in orthogonal_factors(updates, head_rows, rms)]
