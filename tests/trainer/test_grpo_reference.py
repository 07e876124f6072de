"""GRPO as the RL stage runs it (the environment's verdicts -> RL.score -> RolloutBatches' micro-batches ->
PolicyLoss under gradient accumulation) equals a plain reference written here from the papers, on a fixed batch:
the advantages, the loss, its gradient, the ratios and the clip count.

The reference, per group of G responses o_1..o_G of one prompt with rewards r_1..r_G:
  DeepSeekMath (arXiv 2402.03300, 4.1.2, outcome supervision): A_i = (r_i - mean(r)) / std(r), the same for every
    token of o_i (std over the group, population form: the stage's choice; the paper does not say, and the sample
    form only scales every advantage by sqrt(G / (G - 1)));
  ratio_{i,t} = pi_theta(o_{i,t} | q, o_{i,<t}) / pi_old(o_{i,t} | q, o_{i,<t});
  DAPO (arXiv 2503.14476, eq. 8): J = 1 / sum_i |o_i| * sum_i sum_t min(ratio A, clip(ratio, 1 - eps_low,
    1 + eps_high) A) over all the batch's groups (token-level), loss = -J;
  truncated importance sampling against the rollout engine (Yao et al., "Your efficient RL framework secretly brings
    you off-policy RL training", 2025): each token's term times min(pi_old / pi_rollout, C);
  DeepSeekMath's KL, when kept: + beta (pi_ref / pi_theta - log(pi_ref / pi_theta) - 1) per token, in the same mean.
"""

from __future__ import annotations

import math
import random
import types

import pytest
import torch

from trainer.loss import StepTokens
from trainer.stages.config import RLStageConfig
from trainer.stages.grpo import PolicyLoss
from trainer.stages.rl import RL
from trainer.stages.rollout import Rollout, RolloutBatches

V = 9
EPS_LOW, EPS_HIGH, CAP = 0.2, 0.28, 2.0


def _fixed_batch():
    """Three groups of four responses (one group with no reward variance), each response with its own logits
    (leaf tensors: the 'policy'), old and rollout log-probs, and the environment's reward."""
    rng = random.Random(3)
    torch.manual_seed(3)
    groups, logits = [], []
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    k = 0
    for g, rs in enumerate(rewards):
        group = []
        for r in rs:
            n = rng.randint(1, 6)
            tokens = [rng.randrange(V) for _ in range(n)]
            lg = torch.randn(n, V).requires_grad_()
            lp = lg.detach().log_softmax(-1)[torch.arange(n), tokens]
            old = lp + 0.4 * torch.randn(n)  # ratios inside and outside the clip range
            roll = old + 0.5 * torch.randn(n)  # some pi_old / pi_rollout above the cap
            ro = Rollout(types.SimpleNamespace(env="toy"), 100, [1, 2, 100 + k], tokens, roll.tolist())
            ro.extra["old_logprobs"] = old.tolist()
            ro.extra["ref_logprobs"] = (lp + 0.3 * torch.randn(n)).tolist()
            ro.verdict = types.SimpleNamespace(reward=r, correct=r > 0)
            group.append(ro)
            logits.append(lg)
            k += 1
        groups.append(group)
    return groups, logits


def _reference(groups, logits, beta: float):
    """-J of the module docstring, written out token by token; returns (loss, advantages, clipped tokens)."""
    advantages, terms, clipped = [], [], 0
    for group in groups:
        r = [ro.verdict.reward for ro in group]
        mean = sum(r) / len(r)
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / len(r))
        advantages.append([(x - mean) / std if std > 0 else 0.0 for x in r])
    k = 0
    for group, adv in zip(groups, advantages):
        for ro, a in zip(group, adv):
            logp = logits[k].log_softmax(-1)
            for t, tok in enumerate(ro.token_ids):
                ratio = torch.exp(logp[t, tok] - ro.extra["old_logprobs"][t])
                clipped_ratio = torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
                surrogate = torch.minimum(ratio * a, clipped_ratio * a)
                clipped += bool(clipped_ratio * a < ratio * a)
                w = min(math.exp(ro.extra["old_logprobs"][t] - ro.logprobs[t]), CAP)
                term = -surrogate * w
                if beta:
                    log_ref_over = ro.extra["ref_logprobs"][t] - logp[t, tok]
                    term = term + beta * (torch.exp(log_ref_over) - log_ref_over - 1)
                terms.append(term)
            k += 1
    return torch.stack(terms).sum() / len(terms), advantages, clipped


def _stage_loss(groups, logits, beta: float, grad_accum: int):
    """The stage's path: RL.score (no length penalty), micro-batches, PolicyLoss per micro-batch / grad_accum."""
    stage = RL(RLStageConfig(length_penalty=0.0, adv_norm="std"))
    stage.verdicts = lambda rollouts: [ro.verdict for ro in rollouts]
    stage.score(groups)
    rollouts = [ro for g in groups for ro in g]
    if beta == 0:
        for ro in rollouts:
            ro.extra.pop("ref_logprobs", None)
    loader = RolloutBatches(None, grad_accum=grad_accum, pad_id=0, temperature=1.0, replay_routing=False,
                            replay_cut=False)
    parts = loader.micro_batches(rollouts)
    loss = PolicyLoss(eps_low=EPS_LOW, eps_high=EPS_HIGH, tis_cap=CAP, kl_coef=beta)
    total = sum(len(ro.token_ids) for ro in rollouts)
    loss.begin_step(StepTokens(total=total, micro_batches=grad_accum))
    by_prompt = {tuple(ro.prompt_ids): (ro, lg) for ro, lg in zip(rollouts, logits)}
    out = 0.0
    for batch in parts:
        B, T = batch["input_ids"].shape
        rows = []
        for b in range(B):
            ro, lg = by_prompt[tuple(batch["input_ids"][b, :3].tolist())]
            p, n = len(ro.prompt_ids), len(ro.prompt_ids) + len(ro.token_ids) - 1
            rows.append(torch.cat([torch.zeros(p - 1, V), lg, torch.zeros(T - n, V)]))
        extras = {k: v for k, v in batch.items() if k not in ("input_ids", "labels")}
        out = out + loss(torch.stack(rows), batch["labels"], batch=extras) / grad_accum  # the trainer's 1 / M
    return out, [[ro.advantages for ro in g] for g in groups], loss.step_metrics()


def test_grpo_equals_the_papers_reference():
    for beta in (0.0, 0.05):
        for grad_accum in (1, 3):
            groups, logits = _fixed_batch()
            ref, ref_adv, ref_clipped = _reference(groups, logits, beta)
            ref_grads = torch.autograd.grad(ref, logits)
            out, adv, m = _stage_loss(groups, logits, beta, grad_accum)
            grads = torch.autograd.grad(out, logits)
            for a, b in zip(adv, ref_adv):
                assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-7)
            for g, rg in zip(grads, ref_grads):
                torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-7)
            assert m["tokens"] == sum(len(ro.token_ids) for g in groups for ro in g)
            assert m["clipped"] == ref_clipped > 0


def test_the_gradient_raises_better_than_average_responses():
    """The sign: one small step along -grad raises the log-prob of each response whose reward is above its group's
    mean and lowers the others' (no clipping or truncation at ratio 1: old = current, rollout = current)."""
    groups, logits = _fixed_batch()
    k = 0
    for g in groups:
        for ro in g:
            lp = logits[k].detach().log_softmax(-1)[torch.arange(len(ro.token_ids)), ro.token_ids]
            ro.extra["old_logprobs"] = lp.tolist()
            ro.logprobs = lp.tolist()
            k += 1
    out, adv, _ = _stage_loss(groups, logits, 0.0, 2)
    grads = torch.autograd.grad(out, logits)
    k = 0
    for g, ga in zip(groups, adv):
        for ro, a in zip(g, ga):
            def seq_logp(lg):
                return float(lg.log_softmax(-1)[torch.arange(len(ro.token_ids)), ro.token_ids].sum())

            before, after = seq_logp(logits[k].detach()), seq_logp(logits[k].detach() - 1e-2 * grads[k])
            assert (after - before) * a > 0 or a == 0, (a, before, after)
            k += 1
