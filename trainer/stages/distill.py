"""On-policy distillation (`stage=distill`): the student samples with the engine, a teacher scores the student's
tokens, the loss is the per-token reverse KL.

Contract: `Distill` trains with trainer/stages/grpo.py's loss; stage.kl=full (default) differentiates the exact
per-position KL(student || teacher) over the vocabulary at the student's sampled prefixes, stage.kl=sampled the
advantage teacher - student log-prob of the sampled token. Teachers are frozen whole models on every rank
(stage.teacher, and stage.teachers per task family); one trained with another tokenizer is refused. eval/kl (the
exact KL on held-out prompts, fixed seeds) is the headline figure; distill/reverse_kl and the rollout figures are
logged per step.

Design and reasoning: docs/stages.md#on-policy-distillation
"""

from __future__ import annotations

import logging

import torch

from data.envs import get_env, sample_problems
from trainer.parallel.gradients import sum_over_data
from trainer.stages.common import completion_distributions, completion_logprobs, load_frozen, reverse_kl
from trainer.stages.config import ModelRef
from trainer.stages.rl import EVAL_SEED_OFFSET, RolloutStage

log = logging.getLogger(__name__)

__all__ = ["Distill"]


class Distill(RolloutStage):
    name = "distill"
    prefix = "distill"
    progress_keys = ("distill/reverse_kl",)

    def bind(self, job) -> None:
        super().bind(job)
        s = self.stage
        self.default_teacher = None
        if s.teacher.ckpt:
            self.default_teacher = load_frozen(s.teacher, self.device, self.tokenizer_path, what="teacher",
                                               key="stage.teacher.ckpt")
        self.teachers = {}
        for family, ref in s.teachers.items():
            self.teachers[family] = load_frozen(ModelRef(**ref), self.device, self.tokenizer_path,
                                                what=f"teacher of {family}", key=f"stage.teachers.{family}.ckpt")
        for p in self._families():
            self.teacher_for(p)  # every family the prompts can have is covered, before the first step

    def _families(self) -> list[str]:
        return sorted({get_env(e).family for e in self.stage.envs})

    def teacher_for(self, family: str):
        t = self.teachers.get(family, self.default_teacher)
        if t is None:
            raise ValueError(f"no teacher for task family {family!r}: set stage.teacher.ckpt or "
                             f"stage.teachers.{family}.ckpt")
        return t

    def score(self, groups):
        """Per completion token: advantage = teacher log-prob - student log-prob of the sampled token (the
        engine's), plus with stage.kl_baseline the exact reverse KL KL(student || teacher) at that position, over the
        vocabulary (a scoring forward of the student and the teacher's forward, both full distributions). That is the
        advantage's expectation under the student at the position, a baseline that depends on the prefix alone
        (unbiased), so each position's advantages are centred. Without it they average -KL: with finite samples
        every sampled token is pushed down, which raises the student's entropy and with it the KL it should lower
        (BENCHMARKS.md, post-training)."""
        s = self.stage
        rollouts = [r for g in groups for r in g]
        kw = dict(temperature=s.temperature, pad_id=self.template.pad_id)
        # the student's forward is collective (FSDP, tp, ep): one over all of this rank's rollouts, on every rank
        baseline = s.kl == "sampled" and s.kl_baseline
        student = completion_distributions(self.job.pm.module, rollouts, self.device, **kw) if baseline else None
        by_family: dict[str, list[int]] = {}
        for i, r in enumerate(rollouts):
            by_family.setdefault(r.problem.family, []).append(i)
        for family, index in by_family.items():
            teacher = completion_distributions(self.teacher_for(family), [rollouts[i] for i in index], self.device,
                                               **kw)
            for i, t in zip(index, teacher):
                r = rollouts[i]
                picked = t.gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
                adv = picked - torch.tensor(r.logprobs)
                # reward: the sampled estimate of -KL(student || teacher) per token, for the metrics
                r.reward = float(adv.mean()) if len(adv) else 0.0
                if student is not None:
                    adv = adv + reverse_kl(student[i], t)
                r.advantages = adv.tolist()
                if s.kl == "full":  # the loss reads the teacher's distribution at every completion position
                    r.extra["teacher_logprobs"] = t

    def loss(self):
        loss = super().loss()
        loss.full_kl = self.stage.kl == "full"
        return loss

    def step_extra(self, tot: dict) -> dict:
        return {"distill/reverse_kl": -tot["reward_sum"] / max(tot["samples"], 1.0)}

    def evaluate(self) -> dict[str, float] | None:
        s, cfg = self.stage, self.cfg
        problems = sample_problems(list(s.envs), s.num_eval, cfg.trainer.seed + EVAL_SEED_OFFSET,
                                   list(s.difficulty) or None)[self.data_rank::self.data_ranks]
        # efforts spread evenly over stage.effort, as training draws them (one effort alone, e.g. the middle of
        # 1..100, sits at a mode switch of the SFT data, and a held-out figure there measures that switch only)
        lo, hi = s.effort
        n_all = s.num_eval
        efforts = [lo + round(i * (hi - lo) / max(n_all - 1, 1)) for i in range(n_all)][self.data_rank::self.data_ranks]
        groups = self.generate_held_out(list(zip(problems, efforts)), 12_345, routing=False)
        if groups is None:  # a stop signal came
            return None
        rollouts = [g[0] for g in groups]
        total, count = 0.0, 0.0
        by_family: dict[str, list] = {}
        for r in rollouts:
            by_family.setdefault(r.problem.family, []).append(r)
        # one student forward per family present on every rank: the forward is collective under FSDP / tp / ep
        for family in self._families():
            rs = by_family.get(family, [])
            if not rs:  # a matching forward for the ranks that have this family
                rs_dummy = rollouts[:1]
                completion_logprobs(self.job.pm.module, rs_dummy, self.device, temperature=s.temperature,
                                    pad_id=self.template.pad_id, kl_to=self.teacher_for(family))
                continue
            kls = completion_logprobs(self.job.pm.module, rs, self.device, temperature=s.temperature,
                                      pad_id=self.template.pad_id, kl_to=self.teacher_for(family))
            total += sum(sum(k) for k in kls)
            count += sum(len(k) for k in kls)
        total, count, n = sum_over_data(self.job.pm, [total, count, float(len(rollouts))])
        return {"eval/kl": total / max(count, 1.0), "eval/prompts": n}
