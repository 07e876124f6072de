"""Token sampling: greedy, temperature, top-k and top-p, each request with its own seeded generator.

Per row the logits are scaled by 1 / temperature, cut to the top-k, then to the smallest set of the most likely
tokens whose probability reaches top-p (the most likely token always stays), renormalised: that is the sampling
distribution. The token is drawn by inverse CDF from one uniform number of the request's generator, so the same
seed gives the same tokens whatever else shares the batch. Ties (in top-k and in the order top-p accumulates in)
go to the lowest token ids. temperature 0 is greedy: the most likely token (lowest id among ties), log-prob 0 under
its point-mass sampling distribution.

Returned per token: its log-prob under the sampling distribution (what an RL importance ratio needs for the
behaviour policy) and under the model's own distribution (temperature 1, no cut: what the training forward computes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["SamplingParams", "sample"]


@dataclass
class SamplingParams:
    temperature: float = 1.0
    """0 = greedy"""
    top_k: int = 0
    """0 = no cut"""
    top_p: float = 1.0
    """1 = no cut"""
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    """generation ends after any of these (it is returned with the completion)"""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def sampling_logprobs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[V] fp32 logits -> [V] log-probs of the sampling distribution (-inf outside the cut)."""
    z = logits / p.temperature
    order = torch.sort(z, descending=True, stable=True).indices
    keep = torch.ones_like(z, dtype=torch.bool)
    if p.top_k and p.top_k < z.numel():
        keep[order[p.top_k:]] = False
    if p.top_p < 1.0:
        probs = torch.where(keep, z, float("-inf")).softmax(-1)[order]
        before = probs.cumsum(0) - probs  # mass of the tokens ranked above each
        keep[order[before >= p.top_p]] = False
    return torch.where(keep, z, float("-inf")).log_softmax(-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]):
    """logits [B, V] fp32 (the last position of each row) -> (tokens [B] int64, sampling log-probs [B] fp32, model
    log-probs [B] fp32)."""
    model_lp = logits.float().log_softmax(-1)
    tokens, lps = [], []
    for b, p in enumerate(params):
        row = logits[b].float()
        if p.temperature == 0:
            tokens.append(int(row.argmax()))
            lps.append(0.0)
            continue
        lp = sampling_logprobs(row, p)
        u = float(torch.rand((), generator=generators[b], device=generators[b].device))
        cdf = lp.exp().cumsum(0)
        tok = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], device=cdf.device)).clamp(
            max=row.numel() - 1))
        while lp[tok] == float("-inf"):  # a rounding edge of the cdf: step back to the last kept token
            tok -= 1
        tokens.append(tok)
        lps.append(float(lp[tok]))
    t = torch.tensor(tokens, device=logits.device)
    return t, torch.tensor(lps), model_lp.gather(-1, t[:, None]).squeeze(-1).cpu()
