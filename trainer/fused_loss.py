"""The output head and the cross-entropy fused, chunked over tokens: `trainer.fused_loss=true`.

Contract: `linear_cross_entropy(hidden [N, D], weight [V, D], labels, weights, chunk_size=)` returns the weighted
sum of the cross-entropies the plain path computes from fp32 logits and the valid-token count, differentiable in
hidden and weight, without forming the [N, V] logits: at most one chunk's logits exist at a time
(`default_chunk_tokens`: CHUNK_BYTES of fp32 logits), and the backward keeps only its inputs and the per-token
logsumexp. The head's matmul runs in the autocast dtype when autocast is on, else in the inputs' dtype (fp32: equal
to the plain path to fp32 rounding). Not for a vocab-sharded head, the pipeline's last stage or losses that read the
logits (`trainer.train.check_fused_loss` refuses them at start-up).

Design and reasoning: docs/training.md#the-fused-head-and-loss
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.common import autocast_dtype
__all__ = ["IGNORE_INDEX", "CHUNK_BYTES", "default_chunk_tokens", "linear_cross_entropy"]

IGNORE_INDEX = -100  # a label that takes no part in the loss (prompt tokens, padding); torch's cross_entropy default

CHUNK_BYTES = 512 << 20  # fp32 logits of one chunk (the matmul's product and the softmax's temporaries come beside)


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk whose fp32 logits take CHUNK_BYTES (at least one)."""
    return max(1, CHUNK_BYTES // (4 * vocab_size))


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the plain head's F.linear would run in here: autocast's, where autocast is on for the device."""
    return autocast_dtype(hidden.device.type) or torch.promote_types(hidden.dtype, weight.dtype)


def _chunk_logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[n, D] x [V, D] (already in the compute dtype) -> [n, V] fp32, as `head(hidden).float()`."""
    return F.linear(h, w).float()


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk: int, dtype: torch.dtype, token_losses):
        n_tokens = hidden.shape[0]
        lse = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)  # one cast per call, as autocast casts the weight once per forward
            for s in range(0, n_tokens, chunk):
                e = min(s + chunk, n_tokens)
                logits = _chunk_logits(hidden[s:e].to(dtype), w)
                y = labels[s:e]
                valid = y != IGNORE_INDEX
                chunk_lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, torch.where(valid, y, 0).unsqueeze(1)).squeeze(1)
                del logits
                ce = chunk_lse - picked
                if token_losses is not None:  # each token's own cross-entropy, before its weight
                    token_losses[s:e] = torch.where(valid, ce, 0.0)
                if weights is not None:
                    ce = ce * weights[s:e]
                total += torch.where(valid, ce, 0.0).sum()
                lse[s:e] = chunk_lse
        ctx.save_for_backward(hidden, weight, labels, weights, lse)
        ctx.chunk, ctx.dtype = chunk, dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, labels, weights, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        if not (need_hidden or need_weight):
            return None, None, None, None, None, None, None
        dtype, chunk, n_tokens = ctx.dtype, ctx.chunk, hidden.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for s in range(0, n_tokens, chunk):
                e = min(s + chunk, n_tokens)
                h = hidden[s:e].to(dtype)
                y = labels[s:e]
                valid = y != IGNORE_INDEX
                scale = valid.float() * grad_total.float()
                if weights is not None:
                    scale = scale * weights[s:e]
                # d(lse - logit_y) / d logits = softmax - onehot(y), scaled per token; rows not counted are zero
                g = _chunk_logits(h, w).sub_(lse[s:e].unsqueeze(1)).exp_()
                g.scatter_add_(1, torch.where(valid, y, 0).unsqueeze(1),
                               torch.full((e - s, 1), -1.0, dtype=g.dtype, device=g.device))
                g = g.mul_(scale.unsqueeze(1)).to(dtype)
                if need_hidden:
                    grad_hidden[s:e] = (g @ w).to(hidden.dtype)
                if need_weight:
                    grad_weight += (g.t() @ h).float()
                del g
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         weights: torch.Tensor | None = None, *, chunk_size: int | None = None,
                         compute_dtype: torch.dtype | None = None,
                         token_losses: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [..., D] (the head's input), weight [V, D] (the head's, no bias), labels [...] (IGNORE_INDEX: not
    counted), weights [...] per-token loss weights or None -> (the sum over valid tokens of weight x
    cross-entropy of softmax(hidden @ weight^T), a 0-dim fp32 tensor differentiable in hidden and weight; the number
    of valid tokens, a 0-dim int64 tensor). Nothing valid: an exact zero, with zero gradients.

    chunk_size: tokens per chunk (default `default_chunk_tokens(V)`). compute_dtype: the matmul's dtype (default:
    the autocast dtype where autocast is on for hidden's device, else the inputs' dtype). token_losses: a [N] fp32
    tensor (N tokens) the forward fills with each token's unweighted cross-entropy (0 where not counted), for
    metrics: it takes no part in the gradient."""
    for name, t in (("hidden", hidden), ("head weight", weight)):
        if hasattr(t, "full_tensor"):
            raise ValueError(f"trainer.fused_loss: the {name} is a DTensor (a sharded head or sequence); the fused "
                             "loss needs the whole head weight and this rank's tokens as plain tensors")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden.shape)} does not match the head weight "
                         f"{tuple(weight.shape)} ([V, D])")
    flat = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    if flat_labels.shape[0] != flat.shape[0]:
        raise ValueError(f"linear_cross_entropy: {flat.shape[0]} tokens of hidden, {flat_labels.shape[0]} labels")
    flat_weights = None if weights is None else weights.reshape(-1).detach().float()
    chunk = int(chunk_size) if chunk_size else default_chunk_tokens(weight.shape[0])
    if chunk < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size must be positive, got {chunk_size}")
    dtype = compute_dtype or _compute_dtype(hidden, weight)
    if token_losses is not None and (token_losses.shape != flat_labels.shape or token_losses.dtype != torch.float32):
        raise ValueError(f"linear_cross_entropy: token_losses must be a [{flat_labels.shape[0]}] fp32 tensor, got "
                         f"{list(token_losses.shape)} {token_losses.dtype}")
    total = _LinearCrossEntropy.apply(flat, weight, flat_labels, flat_weights, chunk, dtype, token_losses)
    return total, (flat_labels != IGNORE_INDEX).sum()
