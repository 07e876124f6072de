"""Verification of a drafted block (REFERENCE B6 "Acceptance"): which drafts the backbone keeps, and the token that
follows them, so that the tokens emitted are distributed exactly as the backbone's own samples (greedy: exactly the
backbone's greedy tokens).

Contract: `accept_greedy` / `accept_sampled` take the backbone's K + 1 distributions over [last token, d_1 .. d_K]
(and for sampling the drafts' distributions and a generator) and return per row the number of drafts accepted and
the next token. `SpecScheduler` picks how many drafts a step verifies (k in 0..spec_tokens): "fixed" always
spec_tokens, "auto" the k of the most tokens a second by the drafter's confidences and the costs the engine measures
(`ThroughputCurve`).

Design and reasoning: docs/generation.md#verification-and-the-draft-scheduler
"""

from __future__ import annotations

import torch

__all__ = ["accept_greedy", "accept_sampled", "SpecScheduler", "ThroughputCurve", "SCHEDULES"]

SCHEDULES = ("fixed", "auto")


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


class ThroughputCurve:
    """What a decode step costs at each batch size, as the engine measures it: t(k), the seconds of a verify forward of
    k + 1 tokens a row (k = 0..spec_tokens; k = 0 a plain decode step), and the seconds of drafting a block. Each
    measurement moves a running mean (weight `rate` on the new one: the context grows, the machine's load changes);
    what was never measured is None."""

    def __init__(self, spec_tokens: int, rate: float = 0.3):
        if not 0 < rate <= 1:
            raise ValueError(f"ThroughputCurve: rate must be in (0, 1], got {rate}")
        self.spec_tokens, self.rate = spec_tokens, rate
        self._verify: dict[int, list[float | None]] = {}
        self._draft: dict[int, float | None] = {}

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.rate) * old + self.rate * new

    def observe_verify(self, batch: int, k: int, seconds: float) -> None:
        row = self._verify.setdefault(batch, [None] * (self.spec_tokens + 1))
        row[k] = self._mean(row[k], seconds)

    def observe_draft(self, batch: int, seconds: float) -> None:
        self._draft[batch] = self._mean(self._draft.get(batch), seconds)

    def verify_s(self, batch: int) -> list[float | None]:
        """t(k) for k = 0..spec_tokens at this batch size (None: not measured)."""
        return list(self._verify.get(batch, [None] * (self.spec_tokens + 1)))

    def draft_s(self, batch: int) -> float | None:
        return self._draft.get(batch)

    def measured(self, batch: int) -> bool:
        """Every t(k) of this batch size measured."""
        return None not in self.verify_s(batch)


class SpecScheduler:
    """The verification length of each decode step (docs/generation.md#verification-and-the-draft-scheduler). "auto"
    skips drafting after it chose k = 0 (plain decode steps, which cost no drafting) for 1, then 2, 4, ... up to
    `max_skip` steps while it keeps choosing 0, then drafts again to read the confidences."""

    def __init__(self, spec_tokens: int, mode: str = "fixed", max_skip: int = 32, decay: float = 0.9):
        if mode not in SCHEDULES:
            raise ValueError(f"spec_schedule must be one of {list(SCHEDULES)}, got {mode!r}")
        if spec_tokens < 1:
            raise ValueError(f"spec_tokens must be >= 1, got {spec_tokens}")
        self.spec_tokens, self.mode, self.max_skip, self.decay = spec_tokens, mode, max_skip, decay
        self._skip, self._backoff = 0, 1
        self._accepted = self._predicted = 0.0  # decayed sums of the accepted drafts and of the predicted ones

    @property
    def calibration(self) -> float:
        """c: accepted / predicted drafts, each with one more (so 1 before any verification)."""
        return (self._accepted + 1) / (self._predicted + 1)

    def observe(self, survival: torch.Tensor, accepted: torch.Tensor, active: torch.Tensor) -> None:
        """After a verify of k = survival.shape[1] drafts: accepted [B] the drafts kept, active [B] bool the rows that
        were generating, against the accepted drafts their confidences predicted (sum_j prod_{i <= j} s_i)."""
        predicted = torch.cumprod(survival.double(), dim=-1).sum(dim=-1)  # [B]
        self._accepted = self.decay * self._accepted + float(accepted[active].sum())
        self._predicted = self.decay * self._predicted + float(predicted[active].sum())

    def wants_drafts(self) -> bool:
        """Whether this step drafts (False: a plain decode step, k = 0)."""
        if self._skip > 0:
            self._skip -= 1
            return False
        return True

    def expected_tokens(self, survival: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
        """survival [B, K] in [0, 1], left [B] tokens each row may still emit (0: done) -> [K + 1] the batch's
        expected tokens sum_b min(E_b(k), left_b) for k = 0..K."""
        run = self.calibration * torch.cumprod(survival.double(), dim=-1).cumsum(dim=-1)  # [B, K]: c sum_j prod_i s_i
        per_row = 1 + torch.cat((torch.zeros_like(run[:, :1]), run), dim=1)  # [B, K + 1]
        return torch.minimum(per_row, left.double()[:, None]).sum(dim=0)

    def choose(self, survival: torch.Tensor, left: torch.Tensor, verify_s: list[float | None],
               draft_s: float | None) -> int:
        """survival [B, spec_tokens] sigmoid(confidence) of the drafted slots; left [B]; verify_s t(0..spec_tokens)
        and draft_s the drafting seconds (`ThroughputCurve`, measured: "auto" refuses None). Returns k."""
        if self.mode == "fixed":
            return self.spec_tokens
        if None in verify_s or draft_s is None:
            raise ValueError("spec_schedule=auto needs t(k) for every k and the drafting time measured at this batch "
                             f"size, got t={verify_s}, drafting {draft_s}")
        K = self.spec_tokens
        cost = torch.tensor(verify_s, dtype=torch.float64) + torch.tensor([0.0] + [draft_s] * K, dtype=torch.float64)
        k = int((self.expected_tokens(survival, left) / cost).argmax())  # ties: the shorter verify
        if k == 0:
            self._skip, self._backoff = self._backoff, min(2 * self._backoff, self.max_skip)
        else:
            self._backoff = 1
        return k
