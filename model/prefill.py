"""The prefill's pieces on the training forward's kernels: the cache record of rotated, quantised rows from the fused
norm + RoPE + quantisation kernel, and the sparse attention kernel over a call's window, its top-k and the SWA ring
rows of the tokens before the call.

Shape legend: B cache rows, T the call's rows, D latent width, E stored entries, K top-k, n ring rows a call reads
(the W - 1 positions before it, fewer near the sequence start), W window.

Contract: `store_record` returns the parts a `Store` keeps for fake_quant(apply_rope(norm(x))), what the reference
serving path (model/serving.py `_stored`) stores; `ring_attention` is `model.csa2.attend` over [ring rows, new rows]
as window keys and the selected entries, for queries whose positions follow the ring's without a gap. Tensors and
modules' weights only; model/serving.py `prefill_attention` runs a layer on them.

Design and reasoning: docs/generation.md#prefill-on-the-training-kernels
"""

from __future__ import annotations

import torch

from model import kernels as kern

__all__ = ["store_record", "ring_attention"]

_QUANTISED = ("fp8", "fp4", "fp4_ue8m0")  # store formats the fused kernel writes (kernels.norm_rope_fp4.QUANTS)


def store_record(store, x: torch.Tensor, norm, cos: torch.Tensor, sin: torch.Tensor, fmt: str | None) -> tuple:
    """x [B, T, D] before norm (a model.common.RMSNorm, or None) and RoPE (cos, sin [T, R / 2]); fmt: the forward's
    fake-quant of these rows (None: off). Returns the store's parts of the rotated rows [B, T, *].

    The reference stores quantise the pre-quantisation rows when the store's format is the forward's (or the forward
    has none): the fused kernel then writes the record itself, in one pass. Otherwise the forward's value (the fused
    fake-quant) is what the store encodes."""
    if store.fmt in _QUANTISED and fmt in (None, store.fmt):
        from kernels import norm_rope_fp4  # triton: an optional dependency, the kernel path's only

        return norm_rope_fp4.norm_rope_quantize(x.contiguous(), cos, sin, weight=None if norm is None else norm.weight,
                                                eps=None if norm is None else norm.eps, quant=store.fmt,
                                                impl="triton")
    return store.encode(kern.norm_rope_quant(x, norm, cos, sin, fmt, "triton"), None, None)


def ring_attention(q: torch.Tensor, kv_new: torch.Tensor, ring: torch.Tensor | None, ring_ok: torch.Tensor | None,
                   gap: int, kv_cmp: torch.Tensor | None, topk: torch.Tensor | None, sink: torch.Tensor,
                   window: int) -> torch.Tensor:
    """q [B, T, H, D] at positions p0 + t; kv_new [B, T, D] their window keys; ring [B, n, D] the keys at positions
    p0 - gap - n .. p0 - gap - 1 (None: none) with ring_ok [B, n] bool those a row holds; kv_cmp [B, E, D] and topk
    [B, T, K] int32 (-1 empty) the selected entries (None: none). Returns out [B, T, H, D].

    The kernel's window is a slice of the call's rows, so the ring rows (which only the first W - 1 - gap queries
    see, and which a row may not hold) join those queries' selected entries instead: slot E + j is ring row j, -1
    where it is outside the query's window or not held. Those queries run twice (once without the ring); the rest
    never read it."""
    out, _ = kern.sparse_attention(q, kv_new, kv_cmp, topk, sink, window)
    r = min(q.shape[1], window - 1 - gap)  # the queries whose window reaches the ring
    if ring is None or r <= 0:
        return out
    n = ring.shape[1]
    t = torch.arange(r, device=q.device)[:, None]
    j = torch.arange(n, device=q.device)[None]
    seen = (j >= t + gap + n - window + 1)[None] & ring_ok[:, None]  # [B, r, n]: ring position > query's - W
    E = 0 if kv_cmp is None else kv_cmp.shape[1]
    slots = torch.where(seen, E + j, -1).to(torch.int32)
    keys = ring if kv_cmp is None else torch.cat((kv_cmp, ring.to(kv_cmp.dtype)), dim=1)  # [B, E + n, D]
    if topk is not None:
        slots = torch.cat((topk[:, :r], slots), dim=-1)  # [B, r, K + n]
    head, _ = kern.sparse_attention(q[:, :r], kv_new[:, :r], keys, slots, sink, window)
    return torch.cat((head, out[:, r:]), dim=1)
