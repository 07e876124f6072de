"""Verification of a drafted block (REFERENCE B6 "Acceptance"): which drafts the backbone keeps, and the token that
follows them, so that the tokens emitted are distributed exactly as the backbone's own samples (greedy: exactly the
backbone's greedy tokens).

Shape legend: B rows, K drafts per row, V vocabulary. The backbone's verification forward over [last token, d_1 ..
d_K] gives K + 1 distributions: p_t[k] is the backbone's distribution of the token after the prefix ending in d_k
(p_t[0] after the last accepted token), the draft's q[k] the distribution d_{k+1} was sampled from.

Sampling (speculative sampling): d_{k+1} is accepted with probability min(1, p_t[k](d) / q[k](d)), in order; at the
first rejection the next token is drawn from norm(max(p_t[k] - q[k], 0)), and when all K are accepted a bonus token
is drawn from p_t[K]. Greedy: d_{k+1} is accepted while it is the argmax of p_t[k]; the next token is the argmax at
the first mismatch (or of p_t[K]).
"""

from __future__ import annotations

import torch

__all__ = ["accept_greedy", "accept_sampled"]


def _first_rejection(accepted: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> [B] the number of leading Trues (the accepted prefix)."""
    return accepted.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def accept_greedy(target_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_logits [B, K + 1, V], drafts [B, K] -> (accepted [B] in 0..K, next token [B])."""
    best = target_logits.argmax(dim=-1)  # [B, K + 1]
    n = _first_rejection(best[:, :-1] == drafts)
    return n, best.gather(1, n[:, None]).squeeze(1)


def accept_sampled(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: torch.Tensor,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [B, K + 1, V], draft_probs [B, K, V] (each a distribution: sums to 1), drafts [B, K] sampled from
    draft_probs -> (accepted [B] in 0..K, next token [B]). Random numbers from `generator` (on the tensors' device)."""
    B, K = drafts.shape
    p = target_probs[:, :K].gather(-1, drafts[..., None]).squeeze(-1).float()  # [B, K] p_t(d)
    q = draft_probs.gather(-1, drafts[..., None]).squeeze(-1).float()  # [B, K] q(d) > 0: d was drawn from q
    u = torch.rand(B, K, generator=generator, device=drafts.device)
    n = _first_rejection(u * q < p)  # u < p / q, without dividing
    rows = torch.arange(B, device=drafts.device)
    t = target_probs[rows, n].float()  # [B, V] the backbone's distribution where the first draft was rejected
    q_pad = torch.cat((draft_probs.float(), torch.zeros_like(t)[:, None]), dim=1)  # q of the bonus slot: 0
    residual = (t - q_pad[rows, n]).clamp_min(0)
    # A rejection leaves residual mass (p_t(d) < q(d) for the rejected d); the bonus slot's residual is p_t itself.
    # Should rounding leave a rejected row none, its p_t is the distribution (where p_t <= q everywhere, p_t = q).
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, t, residual)
    return n, torch.multinomial(residual, 1, generator=generator).squeeze(1)
