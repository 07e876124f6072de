"""The policy-gradient loss of RL and on-policy distillation: clipped, importance-corrected, token-normalised.

Contract: `PolicyLoss` is an `LMLoss` (trainer/loss.py) whose per-token term is the clip-higher policy gradient of
the advantage (DAPO), weighted by the truncated importance ratio of the training and rollout policies, plus a K3 KL
to a reference when one is kept; with `full_kl`, the exact KL(train || teacher) over the vocabulary instead. It is
summed over the global batch's completion tokens and divided by their number (token-level normalisation). Its
`step_metrics` (clip fraction, entropy, advantages, the train/rollout mismatch; `max_*` entries reduced with MAX)
are summed over data ranks by the stage's callback. docs/stages.md has the formulas.

Design and reasoning: docs/stages.md#the-policy-gradient-loss
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.loss import IGNORE_INDEX, LMLoss
from trainer.stages.common import reverse_kl

__all__ = ["PolicyLoss"]


class PolicyLoss(LMLoss):
    supports_fused = False  # reads the tempered logits themselves (log-probs, entropy): trainer.fused_loss refused

    def __init__(self, *, eps_low: float, eps_high: float, tis_cap: float, kl_coef: float = 0.0,
                 temperature: float = 1.0):
        super().__init__()
        self.eps_low, self.eps_high, self.tis_cap = eps_low, eps_high, tis_cap
        self.kl_coef, self.temperature = kl_coef, temperature
        self.full_kl = False
        """distillation's stage.kl=full: per token the exact KL(train || teacher) over the vocabulary instead of the
        policy gradient (batch["teacher_logprobs"]: the teacher's log-softmax, [B, T, V])"""
        self.sums: dict[str, float] = {}
        self.max_ratio = self.max_ratio_dev = 0.0

    def begin_step(self, tokens) -> None:
        super().begin_step(tokens)
        self.sums = {"tokens": 0.0, "clipped": 0.0, "mismatch_k3": 0.0, "entropy": 0.0, "kl_ref": 0.0,
                     "ratio_dev": 0.0, "adv": 0.0, "adv_abs": 0.0, "adv_pos": 0.0}
        self.max_ratio = self.max_ratio_dev = 0.0

    def __call__(self, logits, labels, weights=None, aux=0.0, batch=None):
        batch = batch or {}
        flat_labels = labels.flatten()
        valid = flat_labels != IGNORE_INDEX
        z = logits.float().flatten(0, 1) / self.temperature
        nll = F.cross_entropy(z, flat_labels, ignore_index=IGNORE_INDEX, reduction="none")
        if hasattr(nll, "full_tensor"):  # loss_parallel: replicated per-token values
            nll = nll.full_tensor()
        logp = -nll
        adv = batch["advantages"].flatten().float()
        old = batch["old_logprobs"].flatten().float() if "old_logprobs" in batch else logp.detach()
        ratio = torch.exp(logp - old)
        clipped_ratio = ratio.clamp(1 - self.eps_low, 1 + self.eps_high)
        pg = -torch.minimum(ratio * adv, clipped_ratio * adv)
        rollout = batch["rollout_logprobs"].flatten().float()
        behaviour = torch.exp(old - rollout)
        if self.tis_cap:
            pg = pg * behaviour.clamp(max=self.tis_cap).detach()
        per_token = pg
        if self.full_kl:
            whole = z.full_tensor() if hasattr(z, "full_tensor") else z  # vocab-sharded under tp: whole rows
            kl = reverse_kl(whole.log_softmax(-1), batch["teacher_logprobs"].flatten(0, 1).float())
            per_token = torch.where(valid, kl, 0.0)
        if self.kl_coef and "ref_logprobs" in batch:
            d = batch["ref_logprobs"].flatten().float() - logp
            k3 = torch.exp(d) - d - 1
            per_token = per_token + self.kl_coef * k3
            self.sums["kl_ref"] += float((k3.detach() * valid).sum())
        n = valid.sum()
        mean = (per_token * valid).sum() / n.clamp_min(1)
        term = torch.where(n > 0, mean * self.tokens.share(n), torch.zeros_like(mean))
        self.lm_terms.append(term.detach())
        with torch.no_grad():
            self._measure(z, valid, ratio * adv > clipped_ratio * adv, old, rollout, behaviour, adv)
        return term + aux

    def _measure(self, z, valid, clip_active, old, rollout, behaviour, adv) -> None:
        s = self.sums
        v = valid.float()
        s["tokens"] += float(v.sum())
        s["clipped"] += float((clip_active.float() * v).sum())  # the min took the clipped term
        d = old - rollout  # log pi_train - log pi_rollout on the sampled tokens
        s["mismatch_k3"] += float(((torch.exp(-d) + d - 1) * v).sum())  # K3 of KL(rollout || train)
        dev = (behaviour - 1).abs()
        s["ratio_dev"] += float((dev * v).sum())
        s["adv"] += float((adv * v).sum())
        s["adv_abs"] += float((adv.abs() * v).sum())
        s["adv_pos"] += float(((adv > 0).float() * v).sum())
        if bool(valid.any()):
            self.max_ratio = max(self.max_ratio, float(behaviour[valid].max()))
            self.max_ratio_dev = max(self.max_ratio_dev, float(dev[valid].max()))
            zz = z.full_tensor() if hasattr(z, "full_tensor") else z
            lp = zz[valid].log_softmax(-1)
            s["entropy"] += float(-(lp.exp() * lp).sum())

    def step_metrics(self) -> dict[str, float]:
        """This rank's sums for the step (the callback reduces them over data ranks)."""
        return {**self.sums, "max_ratio": self.max_ratio, "max_ratio_dev": self.max_ratio_dev}
