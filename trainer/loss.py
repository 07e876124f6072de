"""The loss seam: one language-model loss for the plain and the pipeline paths, normalised over the global batch.

Contract: a step minimises the sum over every valid token of the global batch (label != IGNORE_INDEX, on every data
rank and micro-batch) of its cross-entropy times its weight (`loss_weights`, 1 by default), divided by the number of
valid tokens (`StepTokens.count`, one all-reduce), plus the model's auxiliary losses. `LMLoss.lm` gives each
micro-batch's part as its own mean times its share, so with equal valid counts (pretraining) the loss and gradients
are bitwise the plain mean of means; a micro-batch without valid tokens contributes an exact zero and still runs its
backward. `lm_fused` is the same from the head's input (trainer/fused_loss.py); a loss that reads the logits sets
`supports_fused = False`. With `row_kind`, `kind_sums` gives each kind's token mean (`KindSums`).

Design and reasoning: docs/training.md#the-loss-and-its-normalisation
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trainer.fused_loss import IGNORE_INDEX, linear_cross_entropy

__all__ = ["IGNORE_INDEX", "StepTokens", "LMLoss", "valid_tokens", "KindSums"]


def valid_tokens(labels: torch.Tensor) -> int:
    """Tokens of `labels` that count in the loss (label != IGNORE_INDEX)."""
    return int((labels != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class StepTokens:
    """One optimiser step's normalisation: `total` valid tokens over the global batch, `ranks` over which the
    gradient is averaged (dp x ep x cp), `micro_batches` per rank."""

    total: int
    ranks: int = 1
    micro_batches: int = 1

    def share(self, valid: torch.Tensor) -> torch.Tensor:
        """A micro-batch's weight relative to an equal share of the step (1.0 exactly when every micro-batch of
        every rank holds the same number of valid tokens). valid: its valid-token count (a 0-dim tensor)."""
        return (valid.double() * (self.ranks * self.micro_batches) / max(self.total, 1)).float()


@dataclass
class KindSums:
    """Per row kind k, over the micro-batches so far: `loss[k]` the sum of its valid tokens' cross-entropies,
    `tokens[k]` their count (fp64 device tensors [K]: no host synchronisation per micro-batch)."""

    loss: torch.Tensor
    tokens: torch.Tensor

    def add(self, per_token: torch.Tensor, labels: torch.Tensor, row_kind: torch.Tensor) -> None:
        """per_token [N] (this micro-batch's cross-entropies, any value where not valid), labels [N], row_kind [B]
        with N = B x T."""
        kinds = row_kind.to(per_token.device).long().repeat_interleave(labels.numel() // row_kind.numel())
        valid = labels != IGNORE_INDEX
        self.loss.index_add_(0, kinds, torch.where(valid, per_token.detach(), 0.0).double())
        self.tokens.index_add_(0, kinds, valid.double())


class LMLoss:
    """Cross-entropy over the valid tokens of one micro-batch, weighted per token if asked, times the micro-batch's
    share of the step (`StepTokens.share`), plus the auxiliary losses it is handed. Set the step with
    `begin_step`; each call returns the micro-batch's loss to differentiate (before gradient accumulation's 1 / M)
    and keeps its detached LM term in `lm_terms` (their mean over the step's micro-batches, averaged over data
    ranks, is the global token mean).

    fused: the trainer runs the model without its head and calls this with logits=None, hidden= and head= (the
    head's input [B, T, D] and the head module), computed by `lm_fused` (trainer.fused_loss=true); chunk_size: the
    fused loss's tokens per chunk (None: trainer/fused_loss.py's default); num_kinds: how many row kinds a batch's
    `row_kind` can name (`kind_sums`, docs/training.md#the-loss-and-its-normalisation)."""

    supports_fused = True  # False in a subclass whose loss needs the logits (trainer.fused_loss is then refused)

    num_kinds = 2  # row kinds (data/multimodal.py: TEXT 0, MULTIMODAL 1)

    def __init__(self, fused: bool = False, chunk_size: int | None = None) -> None:
        self.tokens = StepTokens(total=0)
        self.lm_terms: list[torch.Tensor] = []
        self.kind_sums: KindSums | None = None
        self.fused, self.chunk_size = fused, chunk_size

    def begin_step(self, tokens: StepTokens) -> None:
        self.tokens = tokens
        self.lm_terms = []
        self.kind_sums = None

    def _add_kinds(self, per_token: torch.Tensor, labels: torch.Tensor, row_kind: torch.Tensor) -> None:
        if self.kind_sums is None:
            zeros = torch.zeros(self.num_kinds, dtype=torch.float64, device=per_token.device)
            self.kind_sums = KindSums(zeros, zeros.clone())
        self.kind_sums.add(per_token, labels, row_kind)

    def lm(self, logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None,
           row_kind: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, T, V] (a vocab-sharded DTensor under loss_parallel), labels [B, T], weights [B, T] or None
        -> this micro-batch's LM term: its (weighted) mean over valid tokens times its share. row_kind [B]: each
        row's kind, whose sums go to `kind_sums`."""
        flat_logits, flat_labels = logits.float().flatten(0, 1), labels.flatten()
        valid = (flat_labels != IGNORE_INDEX).sum()
        if weights is None and row_kind is None:
            mean = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX)
        else:
            per_token = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX, reduction="none")
            if hasattr(per_token, "full_tensor"):  # loss_parallel: the per-token losses, replicated over tp
                per_token = per_token.full_tensor()
            if row_kind is not None:
                self._add_kinds(per_token, flat_labels, row_kind)
            if weights is not None:
                per_token = per_token * weights.flatten().to(per_token.dtype)
            mean = per_token.sum() / valid.clamp_min(1)
        if hasattr(mean, "full_tensor"):  # loss_parallel: a replicated DTensor, the same value on every tp rank
            mean = mean.full_tensor()
        return self._term(mean, valid)

    def lm_fused(self, hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor,
                 weights: torch.Tensor | None = None, row_kind: torch.Tensor | None = None) -> torch.Tensor:
        """`lm` from the head's input instead of its logits: hidden [B, T, D] (what the head reads), head the output
        head (an nn.Linear without bias; its weight the whole, unsharded one), labels and weights as for `lm`. The
        head's matmul runs as the plain head's would here (call it under the forward's autocast)."""
        if getattr(head, "bias", None) is not None:
            raise ValueError("trainer.fused_loss: the output head has a bias; the fused loss takes a head without")
        per_token = None if row_kind is None else torch.empty(labels.numel(), dtype=torch.float32,
                                                              device=hidden.device)
        total, valid = linear_cross_entropy(hidden, head.weight, labels, weights, chunk_size=self.chunk_size,
                                            token_losses=per_token)
        if row_kind is not None:
            self._add_kinds(per_token, labels.flatten(), row_kind)
        return self._term(total / valid.clamp_min(1), valid)

    def _term(self, mean: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        # 0 / 0 where nothing is valid: an exact zero instead, whose backward is zero too
        term = torch.where(valid > 0, mean * self.tokens.share(valid), torch.zeros_like(mean))
        self.lm_terms.append(term.detach())
        return term

    def __call__(self, logits: torch.Tensor | None, labels: torch.Tensor, weights: torch.Tensor | None = None,
                 aux: torch.Tensor | float = 0.0, batch: dict | None = None, *, hidden: torch.Tensor | None = None,
                 head: torch.nn.Module | None = None) -> torch.Tensor:
        """batch: the micro-batch's other tensors on the device (a stage's loss reads its own, e.g. RL's advantages;
        trainer/stages/grpo.py; `row_kind` [B] is read here: `kind_sums`). logits None: the fused LM term
        (`lm_fused`) from hidden and head."""
        row_kind = None if batch is None else batch.get("row_kind")
        if logits is None:
            if hidden is None or head is None:
                raise ValueError("LMLoss: without logits, the fused loss needs hidden= and head=")
            return self.lm_fused(hidden, head, labels, weights, row_kind) + aux
        return self.lm(logits, labels, weights, row_kind) + aux
