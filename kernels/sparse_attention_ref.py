"""Plain-PyTorch reference of the sparse shared-KV attention kernel (kernels/sparse_attention.py), also the
benchmark's "naive gather-based" baseline, and the top-k id list -> bool mask conversion.

Shape legend: B batch, T tokens, H heads, D latent width, W window, K top-k slots, E compressed entries.
"""

from __future__ import annotations

import torch


def sparse_attention_reference(q, kv_win, kv_cmp, topk_idx, sink, window, *, return_topk_probs: bool = False):
    """Gather-based PyTorch: build each query's window keys [B, T, W, D] (a strided view) and its selected entries
    [B, T, K, D] (a gather), then one softmax over [window ; selected ; sink]. Same numerics as `attend`: logits
    from q's-dtype matmuls read in fp32, probabilities cast to the KV dtype before P @ V."""
    B, T, H, D = q.shape
    W = window
    scale = D ** -0.5
    # key w of query t is kv_win[t - W + 1 + w]; the W - 1 leading pad rows are masked off below
    padded = torch.cat((kv_win.new_zeros(B, W - 1, D), kv_win), dim=1)
    win = padded.unfold(1, W, 1)  # [B, T, D, W] view
    pos = torch.arange(T, device=q.device)[:, None] - W + 1 + torch.arange(W, device=q.device)[None, :]
    logits = torch.einsum("bthd,btdw->bthw", q, win).float() * scale
    logits = logits.masked_fill((pos < 0)[None, :, None, :], float("-inf"))
    parts = [logits]
    if kv_cmp is not None and kv_cmp.shape[1] > 0 and topk_idx.shape[2] > 0:
        K = topk_idx.shape[2]
        idx = topk_idx.long()
        empty = idx < 0
        sel = kv_cmp.gather(1, idx.clamp_min(0).reshape(B, T * K, 1).expand(B, T * K, D)).view(B, T, K, D)
        lc = torch.einsum("bthd,btkd->bthk", q, sel).float() * scale
        parts.append(lc.masked_fill(empty[:, :, None, :], float("-inf")))
    else:
        sel = None
    parts.append(sink.float()[None, None, :, None].expand(B, T, H, 1))
    probs = torch.cat(parts, dim=-1).softmax(dim=-1)
    out = torch.einsum("bthw,btdw->bthd", probs[..., :W].to(kv_win.dtype), win)
    if sel is not None:
        out = out + torch.einsum("bthk,btkd->bthd", probs[..., W:-1].to(sel.dtype), sel)
    if not return_topk_probs:
        return out.to(q.dtype)
    K = 0 if topk_idx is None else topk_idx.shape[2]
    head_sum = probs[..., W:-1].sum(2).detach() if sel is not None else q.new_zeros(B, T, K, dtype=torch.float32)
    return out.to(q.dtype), head_sum


def topk_to_mask(topk_idx: torch.Tensor, num_entries: int) -> torch.Tensor:
    """[B, T, K] int32 (-1 = empty) -> [B, T, E] bool one-hot selection (the cmp_mask of `attend`)."""
    B, T, _ = topk_idx.shape
    idx = topk_idx.long()
    mask = torch.zeros(B, T, num_entries + 1, dtype=torch.bool, device=topk_idx.device)
    # empty slots land in a spare last column that is dropped
    mask.scatter_(-1, torch.where(idx < 0, num_entries, idx), True)
    return mask[..., :num_entries]
