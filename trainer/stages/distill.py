"""On-policy distillation (`stage=distill`): the student samples with the engine, a teacher scores the student's
tokens, the loss is the per-token reverse KL.

The policy-gradient loss of trainer/stages/grpo.py with, per completion token, advantage = teacher log-prob - student
log-prob (the engine's, of the sampled token; no discount, no group baseline): its expected gradient is the
gradient of the reverse KL KL(student || teacher) along the student's own samples. Teachers (frozen whole models on
every rank, trainer/stages/common.py `load_frozen`) may be larger or of another config; stage.teachers routes each
prompt's task family (data/envs/: math, string, code) to its own teacher, stage.teacher takes the rest. A teacher
trained with another tokenizer is refused.

Evaluation (start, every stage.eval_every steps, end): on stage.num_eval held-out prompts, one student sample each
(fixed seeds), the exact per-position KL(student || teacher) over the vocabulary, averaged over completion tokens:
eval/kl, the headline figure. Per step: distill/reverse_kl (the sampled estimate on the step's rollouts) and the
rollout figures RL logs.
"""

from __future__ import annotations

import logging

from trainer.stages.rl import EVAL_SEED_OFFSET, RolloutStage

log = logging.getLogger(__name__)

__all__ = ["Distill"]


class Distill(RolloutStage):
    name = "distill"
    prefix = "distill"

    def bind(self, job) -> None:
        from trainer.stages.common import load_frozen

        super().bind(job)
        s = self.stage
        self.default_teacher = None
        if s.teacher.ckpt:
            self.default_teacher = load_frozen(s.teacher, self.device, self.tokenizer_path, what="teacher",
                                               key="stage.teacher.ckpt")
        self.teachers = {}
        for family, ref in s.teachers.items():
            from trainer.stages.config import ModelRef

            self.teachers[family] = load_frozen(ModelRef(**ref), self.device, self.tokenizer_path,
                                                what=f"teacher of {family}", key=f"stage.teachers.{family}.ckpt")
        for p in self._families():
            self.teacher_for(p)  # every family the prompts can have is covered, before the first step

    def _families(self) -> list[str]:
        from data.envs import get_env

        return sorted({get_env(e).family for e in self.stage.envs})

    def teacher_for(self, family: str):
        t = self.teachers.get(family, self.default_teacher)
        if t is None:
            raise ValueError(f"no teacher for task family {family!r}: set stage.teacher.ckpt or "
                             f"stage.teachers.{family}.ckpt")
        return t

    def score(self, groups):
        from trainer.stages.common import completion_logprobs

        rollouts = [r for g in groups for r in g]
        by_family: dict[str, list] = {}
        for r in rollouts:
            by_family.setdefault(r.problem.family, []).append(r)
        for family, rs in by_family.items():
            lps = completion_logprobs(self.teacher_for(family), rs, self.device, temperature=self.stage.temperature,
                                      pad_id=self.template.pad_id)
            for r, t in zip(rs, lps):
                r.advantages = [a - b for a, b in zip(t, r.logprobs)]
                # reward: the sampled estimate of -KL(student || teacher) per token, for the metrics
                r.reward = sum(r.advantages) / max(len(r.advantages), 1)

    def step_extra(self, tot: dict) -> dict:
        return {"distill/reverse_kl": -tot["reward_sum"] / max(tot["samples"], 1.0)}

    def evaluate(self) -> dict[str, float]:
        from data.envs import sample_problems
        from trainer.parallel.gradients import sum_over_data
        from trainer.stages.common import completion_logprobs

        s, cfg = self.stage, self.cfg
        problems = sample_problems(list(s.envs), s.num_eval, cfg.trainer.seed + EVAL_SEED_OFFSET,
                                   list(s.difficulty) or None)[self.data_rank::self.data_ranks]
        rng_effort = (s.effort[0] + s.effort[1]) // 2
        groups = self.generate([(p, rng_effort) for p in problems], 12_345, group_size=1, routing=False)
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
