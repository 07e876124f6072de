"""CSA2 pieces: compressor, indexer, top-k, the hierarchical candidate pool (SPEC 1.2-1.3, REFERENCE A3-A4) and
`attend`, the reference sparse shared-KV attention (A2) that the layer and serving both run.

Shape legend: B batch, T tokens, E compressed entries (T // ratio), D latent width (512 in the flagship),
Hi indexer heads, Di indexer head dim, K top-k, H query heads, S window keys.

Visibility: entry t (tokens t*m .. t*m+m-1) is visible to the query at position p iff t < (p + 1) // m, i.e. only
once its whole group has arrived. Every selection below scores only visible entries, so nothing depends on the future.
"""

from __future__ import annotations

import torch
from torch import nn

from model.common import RMSNorm, full_precision, init_linear, linear


def visible_mask(num_queries: int, num_entries: int, ratio: int, device, q_offset: int = 0) -> torch.Tensor:
    """[T, E] bool: entry t visible to query p iff t < (p + 1) // ratio. Query i sits at position q_offset + i
    (a chunk of a longer sequence under context parallelism); entries are indexed from the sequence start."""
    p = torch.arange(num_queries, device=device) + q_offset
    t = torch.arange(num_entries, device=device)
    return t[None, :] < ((p + 1) // ratio)[:, None]


class Compressor(nn.Module):
    """Every `ratio` consecutive tokens make one main-KV entry: a per-channel softmax gate over the group weights the
    tokens' projections (ratio > 1), or a plain projection (ratio 1); then RMSNorm. No overlap between groups and no
    absolute position embedding (CSA2). Output is the pre-RoPE latent [B, E, D]; a trailing partial group is dropped
    (it is invisible to every query of this sequence anyway)."""

    def __init__(self, dim: int, latent_dim: int, ratio: int, eps: float):
        super().__init__()
        self.ratio = ratio
        self.wkv = linear(dim, latent_dim)
        self.wgate = linear(dim, latent_dim) if ratio > 1 else None
        self.norm = RMSNorm(latent_dim, eps)

    def init_weights(self, std: float) -> None:
        init_linear(self.wkv, std)
        if self.wgate is not None:
            init_linear(self.wgate, std)
        self.norm.init_weights()

    def forward(self, h: torch.Tensor, norm: bool = True) -> torch.Tensor:
        """h [B, T, dim] -> [B, E, D]. norm=False: the latent before `self.norm`, for a caller that applies the norm
        in its next pass (model.kernels.norm_rope_quant's fused kernel)."""
        B, T, _ = h.shape
        m = self.ratio
        E = T // m
        if m == 1:
            latent = self.wkv(h)
        else:
            h = h[:, : E * m]
            # the reference pools in fp32 (weights upcast): the gate softmax over 2 tokens is precision-sensitive
            with full_precision(h.device.type):  # fp32 under a bf16 autocast too
                kv = nn.functional.linear(h.float(), self.wkv.weight.float())
                gate = nn.functional.linear(h.float(), self.wgate.weight.float())
                # (the width named: with no whole group yet, E = 0 and a -1 would be ambiguous)
                kv, gate = kv.view(B, E, m, kv.shape[-1]), gate.view(B, E, m, gate.shape[-1])
            latent = (gate.softmax(dim=2) * kv).sum(dim=2).to(h.dtype)  # [B, E, D]
        return self.norm(latent) if norm else latent


class Indexer(nn.Module):
    """Lightning-style indexer: score[p, t] = sum_h w[p, h] * relu(q[p, h] . k[t]) / sqrt(Di).

    Queries come from the attention's low-rank query state (q_res), head weights from the layer input, keys from the
    compressed latent (only Full layers own `wk`; Reindex layers use their KV source's keys). The indexer's inputs are
    detached by the caller: it learns only from its KL loss, never moves the backbone.
    """

    def __init__(self, dim: int, q_lora_rank: int, latent_dim: int, num_heads: int, head_dim: int,
                 owns_keys: bool, eps: float):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.wq_b = linear(q_lora_rank, num_heads * head_dim)
        self.weights_proj = linear(dim, num_heads)
        self.wk = linear(latent_dim, head_dim) if owns_keys else None
        self.k_norm = RMSNorm(head_dim, eps) if owns_keys else None

    def init_weights(self, std: float) -> None:
        init_linear(self.wq_b, std)
        init_linear(self.weights_proj, std)
        if self.wk is not None:
            init_linear(self.wk, std)
            self.k_norm.init_weights()

    def keys(self, latent: torch.Tensor, norm: bool = True) -> torch.Tensor:
        """[B, E, D] pre-RoPE latent -> [B, E, Di] pre-RoPE keys; norm=False: before `k_norm` (as the compressor)."""
        k = self.wk(latent)
        return self.k_norm(k) if norm else k

    def queries(self, q_res: torch.Tensor) -> torch.Tensor:
        """[B, T, q_lora] -> [B, T, Hi, Di] pre-RoPE queries."""
        return self.wq_b(q_res).unflatten(-1, (self.num_heads, self.head_dim))

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, dim] -> [B, T, Hi] fp32, scaled by Hi^-1/2 (may be negative)."""
        return self.weights_proj(x).float() * self.num_heads ** -0.5


def index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [B, T, Hi, Di], w [B, T, Hi], k [B, E, Di] -> scores [B, T, E] in fp32 (no masking)."""
    dots = torch.einsum("bthd,bed->bthe", q.float(), k.float()).relu()
    return torch.einsum("bthe,bth->bte", dots, w) * q.shape[-1] ** -0.5


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T, E] masked scores (-inf = not allowed) -> [B, T, E] bool selection of the top min(k, E) allowed entries.
    Picks that land on -inf (fewer than k allowed entries) are dropped. Ties at the k-th value go to the lowest
    entry ids (the Triton kernel's rule, kernels/topk.py): the choice depends on the scores alone, not on how many
    invisible entries trail them, so the inference cache (fewer entries so far) picks what the full forward picks."""
    k = min(k, scores.shape[-1])
    if k == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    # every entry above the k-th largest value, then the lowest-id entries equal to it until k are taken
    kth = scores.topk(k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(-1, keepdim=True)
    take = tied & (tied.cumsum(-1) <= room)
    return (above | take) & (scores > float("-inf"))


def selected_ids(selection: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T, E] bool selection -> [B, T, k] int32 entry ids in increasing order, -1 past the selected ones (the
    record an RL rollout keeps of an index source's choice)."""
    E = selection.shape[-1]
    if E < k:
        selection = nn.functional.pad(selection, (0, k - E))
        E = k
    # a selected entry's key is E - id (distinct, > 0; unselected 0): the k largest are the selected ids, ascending
    key = selection.to(torch.int32) * (E - torch.arange(E, dtype=torch.int32, device=selection.device))
    vals, idx = key.topk(k, dim=-1)
    return torch.where(vals > 0, idx, -1).to(torch.int32)


def ids_to_selection(ids: torch.Tensor, num_entries: int) -> torch.Tensor:
    """`selected_ids`' inverse: [B, T, K] int32 ids (-1 = none) -> [B, T, E] bool."""
    sel = torch.zeros(*ids.shape[:-1], num_entries + 1, dtype=torch.bool, device=ids.device)
    where = torch.where((ids >= 0) & (ids < num_entries), ids.long(), num_entries)
    return sel.scatter_(-1, where, True)[..., :num_entries]


def candidate_pool(scores: torch.Tensor, ratio: int, block_size: int, topk_blocks: int,
                   q_offset: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The hierarchical candidate pool (SPEC 1.3, REFERENCE A4): [B, T, E] masked scores -> [B, T, E] bool.

    Blocks of `block_size` entries score the max inside the block; the block holding the query's newest visible entry
    is always kept; the best min(topk_blocks, n_blocks) blocks with a finite score form the pool. Query i sits at
    position q_offset + i (as in `visible_mask`), or at positions[b, i] when given ([B, T]: the inference cache)."""
    B, T, E = scores.shape
    nb = -(-E // block_size)
    pad = nb * block_size - E
    s = nn.functional.pad(scores, (0, pad), value=float("-inf")) if pad else scores
    block = s.view(B, T, nb, block_size).amax(-1)  # [B, T, nb]
    if positions is None:
        positions = (torch.arange(T, device=scores.device) + q_offset)[None].expand(B, T)
    newest = (positions + 1) // ratio - 1  # [B, T] newest visible entry, -1 if none
    has = newest >= 0
    nb_idx = (newest.clamp(min=0) // block_size)[..., None]
    forced = torch.where(has[..., None], float("inf"), block.gather(-1, nb_idx))
    block = block.scatter(-1, nb_idx, forced)
    keep = select_topk(block, topk_blocks)  # [B, T, nb]
    return keep.repeat_interleave(block_size, dim=-1)[..., :E]


def attend(q, kv_win, kv_cmp, win_mask, cmp_mask, sink):
    """Reference sparse shared-KV attention (the Triton kernel must equal this).

    q [B, T, H, D]; kv_win [B, S, D] window keys (S = T, or h + T with a context-parallel halo of h earlier rows
    first, or the cache's ring then the new rows); kv_cmp [B, E, D] or None; win_mask [T, S] or [B, T, S] bool;
    cmp_mask [B, T, E] bool; sink [H] fp32.
    Returns out [B, T, H, D] (q's dtype) and the fp32 probabilities over compressed entries [B, H, T, E] (None
    without compressed entries).
    """
    D = q.shape[-1]
    scale = D ** -0.5
    logits = torch.einsum("bthd,bsd->bhts", q, kv_win).float() * scale
    logits = logits.masked_fill(~(win_mask[:, None] if win_mask.dim() == 3 else win_mask), float("-inf"))
    if kv_cmp is not None:
        lc = torch.einsum("bthd,bed->bhte", q, kv_cmp).float() * scale
        lc = lc.masked_fill(~cmp_mask[:, None], float("-inf"))
        logits = torch.cat((logits, lc), dim=-1)
    # the sink joins the max and the denominator only (a learned "attend to nothing" column)
    sink_col = sink.float()[None, :, None, None].expand(*logits.shape[:-1], 1)
    probs = torch.cat((logits, sink_col), dim=-1).softmax(dim=-1)[..., :-1]
    S = kv_win.shape[1]
    out = torch.einsum("bhts,bsd->bthd", probs[..., :S].to(kv_win.dtype), kv_win)
    p_cmp = None
    if kv_cmp is not None:
        p_cmp = probs[..., S:]
        out = out + torch.einsum("bhte,bed->bthd", p_cmp.to(kv_cmp.dtype), kv_cmp)
    return out.to(q.dtype), p_cmp
