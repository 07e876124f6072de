"""Muon: momentum orthogonalised by a Newton-Schulz iteration, for weight matrices (SPEC 1.7).

A matrix parameter's update is the orthogonal polar factor of its Nesterov momentum (U V^T of its SVD U S V^T),
approximated without an SVD by an odd matrix polynomial applied to the normalised momentum:

    X <- a X + b (X X^T) X + c (X X^T)^2 X

with the report's hybrid schedule: 8 steps with (a, b, c) = (3.4445, -4.7750, 2.0315), which pull every singular
value into a band around 1 fast but do not converge inside it, then 2 steps with (2, -1.5, 0.5), the polynomial
whose fixed point 1 is superattracting (p(1) = 1, p'(1) = 0), which narrow the band. Run in bf16 on a GPU (the
iteration is self-correcting, so bf16's rounding does not accumulate), in fp32 on the CPU.

Blocks. One parameter is orthogonalised as a batch of blocks [N, m, n], each on its own:
- a plain matrix [m, n] is one block;
- stacked experts [E, m, n] are E blocks (one per expert, as per-expert Muon);
- head-wise Muon (the query and key projections of the attention and the indexer, `head_rows` r) splits the rows
  [H * r, n] into H blocks [r, n], one per head.
Blocks of one shape are stacked across parameters, so a step runs one batched iteration per block shape.

Scale. An orthogonal [m, n] block has RMS 1 / sqrt(max(m, n)); the update is rescaled by rms * sqrt(max(m, n)) so
its RMS is `rms` whatever the shape. rms = 0.2 matches AdamW's typical update RMS (0.2-0.4, Moonlight, arXiv
2502.16982), so AdamW's learning rate and weight decay carry over.
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
