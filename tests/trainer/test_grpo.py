"""GRPO's pieces (trainer/stages/): group advantages, the effort length penalty, the policy loss against a
hand-computed one, and a toy task GRPO must learn: the reward depends on the first sampled token."""

from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch

import model as model_pkg
from tests.helpers import load_config
from tests.model.test_cache import EXACT_STORE
from trainer.engine import Engine
from trainer.loss import StepTokens
from trainer.stages.grpo import PolicyLoss
from trainer.stages.rl import group_advantages, shaped_reward
from trainer.stages.rollout import Rollout, RolloutBatches, generate_groups


def test_group_advantages_and_effort_penalty():
    a = group_advantages([1.0, 0.0, 0.0, 1.0], "std")  # mean 0.5, std 0.5
    assert [round(x, 4) for x in a] == [1.0, -1.0, -1.0, 1.0]
    assert group_advantages([2.0, 1.0], "mean") == [0.5, -0.5]
    assert shaped_reward(1.0, True, 24, 100, 1.0, 24) == 1.0  # effort 100: length is free
    assert math.isclose(shaped_reward(1.0, True, 24, 20, 1.0, 24), math.exp(-0.8))
    assert shaped_reward(1.0, True, 6, 20, 1.0, 24) > shaped_reward(1.0, True, 12, 20, 1.0, 24)
    assert shaped_reward(0.0, False, 24, 20, 1.0, 24) == 0.0


def test_policy_loss_matches_the_formula():
    torch.manual_seed(0)
    B, T, V = 2, 5, 11
    logits = torch.randn(B, T, V, requires_grad=True)
    labels = torch.randint(0, V, (B, T))
    labels[0, :2] = -100
    adv = torch.randn(B, T)
    lp0 = logits.detach().log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    old = lp0 + torch.randn(B, T) * 0.5  # some ratios inside the clip range, some outside
    rollout = old + torch.randn(B, T) * 0.3
    loss = PolicyLoss(eps_low=0.2, eps_high=0.28, tis_cap=2.0)
    loss.begin_step(StepTokens(total=int((labels != -100).sum())))
    out = loss(logits, labels, batch={"advantages": adv, "old_logprobs": old, "rollout_logprobs": rollout})
    lp = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    ratio = torch.exp(lp - old)
    pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv) * torch.exp(old - rollout).clamp(max=2.0)
    valid = labels != -100
    torch.testing.assert_close(out, (pg * valid).sum() / valid.sum())
    m = loss.step_metrics()
    assert m["tokens"] == valid.sum() and 0 < m["clipped"] < m["tokens"]


def test_grpo_learns_a_first_token_task():
    """Reward 1 when the first sampled token is in the lower half of the vocabulary: a few GRPO steps (engine
    rollouts, group advantages, the clipped loss) take its probability from about a half to nearly one."""
    cfg = load_config("v41_tiny")
    V = 32  # a vocabulary the group's 16 samples cover: the reward's structure is learnable in a few steps
    cfg = dataclasses.replace(cfg, vocab_size=V, quant=dataclasses.replace(cfg.quant, **EXACT_STORE),
                              engram=dataclasses.replace(cfg.engram, compressed_vocab_size=V))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = model_pkg.build(cfg)
    model.to_empty(device="cpu")
    model.init_weights()
    prompt = [5, 17, 3, 9, 4]
    template = types.SimpleNamespace(render_prompt=lambda text, effort: prompt, end_id=V + 1)
    engine = Engine(model, replay="none")
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = RolloutBatches(None, grad_accum=1, pad_id=0, temperature=1.0, replay_routing=True, replay_cut=False)
    loss = PolicyLoss(eps_low=0.2, eps_high=0.28, tis_cap=2.0)

    def p_lower() -> float:
        model.eval()
        with torch.no_grad():
            return float(model(torch.tensor([prompt]))[0, -1].softmax(-1)[: V // 2].sum())

    start = p_lower()
    problem = types.SimpleNamespace(prompt="", env="toy")
    for step in range(12):
        (group,) = generate_groups(engine, template, [(problem, 100)], group_size=16, max_new_tokens=2,
                                   temperature=1.0, seed=step * 100, return_routing=True)
        rewards = [float(r.token_ids[0] < V // 2) for r in group]
        for r, a in zip(group, group_advantages(rewards, "std")):
            r.advantages = a
        (batch,) = loader.micro_batches(group)
        loss.begin_step(StepTokens(total=int((batch["labels"] != -100).sum())))
        model.train()
        out = model(batch["input_ids"], routing=batch["routing"])
        extras = {k: batch[k] for k in ("advantages", "rollout_logprobs")}
        opt.zero_grad()
        loss(out, batch["labels"], batch=extras).backward()
        opt.step()
        if step == 0:  # the first step's forward is the rollout's policy: the engine's log-probs agree
            assert loss.step_metrics()["max_ratio"] < 1 + 1e-4
    end = p_lower()
    assert 0.4 < start < 0.6 and end > 0.9, (start, end)


def test_micro_batches_deal_every_rollout_once_and_pad_empty_ones():
    loader = RolloutBatches(None, grad_accum=3, pad_id=2, temperature=1.0, replay_routing=False, replay_cut=True)
    rs = [Rollout(None, 50, [1, 2, 3], [4] * n, [-0.5] * n, advantages=float(n)) for n in (1, 4, 2, 3)]
    parts = loader.micro_batches(rs)
    assert len(parts) == 3 and sum((p["labels"] != -100).sum().item() for p in parts) == 10
    for p in parts:
        # a label only where a completion token is predicted, from the prompt's last token on
        assert ((p["labels"] != -100) == (p["advantages"] != 0)).all()
        assert (p["replay_cuts"].decoder == 3).all()
    empty = RolloutBatches(None, grad_accum=5, pad_id=2, temperature=1.0, replay_routing=False,
                           replay_cut=False).micro_batches(rs)[4]
    assert (empty["labels"] == -100).all() and empty["input_ids"].shape[0] == 1


class _Fixed(torch.nn.Module):
    """A 'teacher' whose next-token distribution is the same everywhere: softmax(bias)."""

    def __init__(self, bias):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.tensor(bias))

    def forward(self, ids):
        return self.bias.expand(*ids.shape, -1)


def test_distillation_routes_each_task_family_to_its_teacher():
    from trainer.stages.config import DistillStageConfig, ModelRef
    from trainer.stages.distill import Distill

    stage = Distill(DistillStageConfig(teacher=ModelRef(ckpt="x")))
    stage.device, stage.template = torch.device("cpu"), types.SimpleNamespace(pad_id=0)
    math_t, default_t = _Fixed([0.0, 2.0, 0.0, 0.0]), _Fixed([0.0, 0.0, 0.0, 3.0])
    stage.teachers, stage.default_teacher = {"math": math_t}, default_t
    lps = [-1.0, -2.0]
    groups = [[Rollout(types.SimpleNamespace(family=f), 50, [1, 2], [1, 3], list(lps))] for f in ("math", "string")]
    stage.score(groups)
    for (r,), teacher in zip(groups, (math_t, default_t)):
        want = teacher.bias.detach().log_softmax(-1)[[1, 3]]
        assert r.advantages == pytest.approx((want - torch.tensor(lps)).tolist())  # teacher - student, per token
        # stage.kl=full (the default): the loss reads the teacher's log-softmax at each completion position
        torch.testing.assert_close(r.extra["teacher_logprobs"], teacher.bias.detach().log_softmax(-1).expand(2, -1))
    # stage.kl=sampled with the baseline: each position's exact KL(student || teacher) joins its token's advantage
    stage.stage = DistillStageConfig(teacher=ModelRef(ckpt="x"), kl="sampled")
    student = _Fixed([1.0, 0.0, 0.5, 0.0])
    stage.job = types.SimpleNamespace(pm=types.SimpleNamespace(module=student))
    for (r,) in groups:
        r.extra.clear()
    stage.score(groups)
    s_lp = student.bias.detach().log_softmax(-1)
    for (r,), teacher in zip(groups, (math_t, default_t)):
        t_lp = teacher.bias.detach().log_softmax(-1)
        kl = float((s_lp.exp() * (s_lp - t_lp)).sum())
        assert r.advantages == pytest.approx((t_lp[[1, 3]] - torch.tensor(lps) + kl).tolist())
        assert r.reward == pytest.approx(float((t_lp[[1, 3]] - torch.tensor(lps)).mean()))  # the sampled -KL
        assert "teacher_logprobs" not in r.extra
    stage.teachers, stage.default_teacher = {"math": math_t}, None
    with pytest.raises(ValueError, match="no teacher for task family 'code'"):
        stage.teacher_for("code")


def test_the_full_kl_loss_is_the_exact_reverse_kl():
    """Distillation's stage.kl=full: per completion token sum_v p (log p - log q) over the vocabulary, token-mean."""
    torch.manual_seed(1)
    B, T, V = 2, 4, 7
    logits = torch.randn(B, T, V, requires_grad=True)
    labels = torch.randint(0, V, (B, T))
    labels[1, :3] = -100
    teacher = torch.randn(B, T, V).log_softmax(-1)
    loss = PolicyLoss(eps_low=0.2, eps_high=0.28, tis_cap=0.0)
    loss.full_kl = True
    loss.begin_step(StepTokens(total=int((labels != -100).sum())))
    zeros = torch.zeros(B, T)
    out = loss(logits, labels, batch={"advantages": zeros, "rollout_logprobs": zeros, "teacher_logprobs": teacher})
    lp = logits.log_softmax(-1)
    kl = (lp.exp() * (lp - teacher)).sum(-1)
    valid = labels != -100
    torch.testing.assert_close(out, (kl * valid).sum() / valid.sum())
