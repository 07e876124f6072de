"""RL on verifiable environments (`stage=rl`): GRPO with the choices practitioners converged on, and effort control.

Contract: `RL` draws stage.prompts_per_step prompts a step (a fixed training set of stage.train_prompts visited in
epochs, or fresh draws; levels and efforts stratified), samples stage.group_size completions of each with the engine
(trainer/stages/rollout.py), scores them with the environment, discounts a correct response's reward by its length
at low effort, normalises it within the group, drops groups whose rewards do not vary (dynamic sampling, up to
stage.max_rounds rounds) and trains with trainer/stages/grpo.py's loss. Logs rl/* per step (reward, success,
ratios, advantages, entropy, rollout tokens/s) and eval/success_e20 / _e80 on held-out prompts every
stage.eval_every steps. Layouts: dp, FSDP, tp, ep; pipeline and context parallelism are refused.

Design and reasoning: docs/stages.md#rl-on-verifiable-environments
"""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.distributed as dist

from data.envs import get_env, sample_problems
from trainer.callbacks import Callback
from trainer.engine import Engine
from trainer.parallel.gradients import sum_over_data
from trainer.stages.base import Stage
from trainer.stages.common import completion_logprobs, load_frozen, stage_tokenizer
from trainer.stages.grpo import PolicyLoss
from trainer.stages.rollout import (PromptSet, Rollout, RolloutBatches, draw_prompts, engine_replay, generate_groups,
                                    prompt_seed)

log = logging.getLogger(__name__)

__all__ = ["RolloutStage", "RL", "shaped_reward", "group_advantages"]

EVAL_EFFORTS = (20, 80)
EVAL_SEED_OFFSET = 7_919_000  # held-out prompts: a seed stream the training prompts never use
TRAIN_SET_ROUND = 1_000  # stage.train_prompts' set: prompt_seed's round 1000, one no step's refills reach


def shaped_reward(reward: float, correct: bool, length: int, effort: int, penalty: float, max_new_tokens: int) -> float:
    """Effort control: the exponential length penalty of a correct response (see the module docstring)."""
    if not correct or penalty == 0:
        return reward
    return reward * math.exp(-penalty * (100 - effort) / 100 * length / max_new_tokens)


def group_advantages(rewards: list[float], norm: str) -> list[float]:
    mean = sum(rewards) / len(rewards)
    if norm == "mean":
        return [r - mean for r in rewards]
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    return [(r - mean) / (std + 1e-6) for r in rewards]


class RolloutStage(Stage):
    """What RL and distillation share: the rollout loader, the engine, the loss, the per-step metrics."""

    name = "rollout"
    prefix = "rl"
    progress_keys = ("rl/reward", "rl/success")

    def __init__(self, stage):
        self.stage = stage
        self.job = self.engine = self.loader = None

    def batches(self, cfg, data_rank: int, data_ranks: int, *, progress: bool = False):
        s = self.stage
        self.check_layout(cfg.parallel)
        if s.prompts_per_step % data_ranks:
            raise ValueError(f"stage.prompts_per_step={s.prompts_per_step} must be a multiple of the data ranks "
                             f"(dp_replicate x dp_shard x ep = {data_ranks})")
        self.cfg, self.data_rank, self.data_ranks = cfg, data_rank, data_ranks
        self.template, info = stage_tokenizer(cfg, progress=progress)
        self.tokenizer_path = info.path  # what a frozen model (RL's reference, a teacher) must have been trained with
        self.local_prompts = s.prompts_per_step // data_ranks
        # the job's training set: every rank holds it whole (it is small) and takes its slice of each step's
        self.prompt_set = (PromptSet(s, s.train_prompts, prompt_seed(cfg.trainer.seed, 0, 0, TRAIN_SET_ROUND),
                                     s.prompts_per_step) if s.train_prompts else None)
        self.replay = engine_replay(s)
        self.loader = RolloutBatches(self.make_step, grad_accum=cfg.trainer.grad_accum, pad_id=self.template.pad_id,
                                     seq_len=cfg.data.seq_len,
                                     temperature=s.temperature, replay_routing=s.replay_routing,
                                     replay_cut=s.bounded_replay_sim and self.replay == "window")
        return self.loader, info

    def check_layout(self, parallel) -> None:
        if parallel.pp > 1 or parallel.cp > 1 or parallel.sequence_parallel or parallel.engram_shard:
            raise ValueError(f"stage={self.stage.name} generates its rollouts with the training model, which needs "
                             "the whole model and whole sequences on every rank: parallel.pp and parallel.cp must "
                             "be 1, parallel.sequence_parallel and parallel.engram_shard false (use dp_replicate, "
                             f"dp_shard, tp, ep); got pp={parallel.pp}, cp={parallel.cp}, "
                             f"sequence_parallel={parallel.sequence_parallel}, engram_shard={parallel.engram_shard}")

    def bind(self, job) -> None:
        self.job = job
        self.device = next(job.pm.module.parameters()).device
        mode = self.stage.rollout_cuda_graph
        graph = mode == "on" or (mode == "auto" and self.device.type == "cuda" and job.pm.meshes is None
                                 and not dist.is_initialized())
        try:
            self.engine = Engine(job.pm, max_batch=self.stage.max_batch, max_len=self.cfg.data.seq_len,
                                 replay=self.replay, cuda_graph=graph, serving_kernels=self.stage.rollout_kernels,
                                 compile_decode=None if self.stage.rollout_compile == "off" else self.stage.rollout_compile)
        except ValueError as e:  # Engine's refusals: a CUDA graph without a GPU or under a parallel plan, kernels
            key = "rollout_kernels" if "serving_kernels" in str(e) else "rollout_cuda_graph"
            raise ValueError(f"stage.{key}={getattr(self.stage, key)}: {e}; use stage.{key}=auto") from None

    def loss(self):
        s = self.stage
        self._loss = PolicyLoss(eps_low=s.eps_low, eps_high=s.eps_high, tis_cap=s.tis_cap,
                                kl_coef=getattr(s, "kl_coef", 0.0), temperature=s.temperature)
        return self._loss

    def callbacks(self):
        return [RolloutMetrics(self), HeldOutEval(self)]

    # -- one step's rollouts -----------------------------------------------------------------------------------------
    def generate(self, prompts, seed: int, *, temperature=None, group_size=None, routing=None):
        s = self.stage
        return generate_groups(self.engine, self.template, prompts, group_size=group_size or s.group_size,
                               max_new_tokens=s.max_new_tokens,
                               temperature=s.temperature if temperature is None else temperature, seed=seed,
                               return_routing=s.replay_routing if routing is None else routing)

    def generate_held_out(self, prompts, seed: int, **kw) -> list[list[Rollout]] | None:
        """`generate` for an evaluation (one completion a prompt), one engine batch (stage.max_batch prompts) at a
        time, the ranks agreeing before each whether a stop signal came: None once one did, so that a stop during a
        long evaluation is honoured within trainer.stop_deadline_s. The batches and seeds, and so the completions,
        are those of one `generate` call."""
        job, n, groups, start = self.job, self.stage.max_batch, [], 0
        while self.engine.lockstep.any_calls(start < len(prompts)):  # a rank with none left matches the others' calls
            if job.stop is not None and job.stop.agreed(job.rt.distributed):
                return None
            groups += self.generate(prompts[start:start + n], seed + start * 1009, group_size=1, **kw)
            start += n
        return groups

    def new_stats(self) -> dict[str, float]:
        stats = {"reward_sum": 0.0, "raw_reward_sum": 0.0, "samples": 0.0, "correct": 0.0, "len_sum": 0.0,
                 "groups_kept": 0.0, "groups_drawn": 0.0, "groups_zero_var": 0.0, "tokens_generated": 0.0}
        for env in self.stage.envs:
            stats[f"correct/{env}"] = stats[f"count/{env}"] = 0.0
        return stats

    def score(self, groups: list[list[Rollout]]) -> None:
        """Fill each rollout's reward, correct and advantages (RL: the environment's verdict, effort-shaped, then
        normalised in its group; distillation: the teacher's per-token log-probs)."""
        raise NotImplementedError

    def finish_groups(self, groups: list[list[Rollout]]) -> list[list[Rollout]]:
        """The groups kept for training."""
        return groups

    def step_prompts(self, step: int, seed: int) -> list[tuple[object, int]]:
        """The job's prompts of `step` (all data ranks'): the training set's next ones, or a fresh stratified draw."""
        if self.prompt_set is not None:
            return self.prompt_set.step_prompts(step)
        return draw_prompts(self.stage, self.stage.prompts_per_step, seed)

    def refill_prompts(self, n: int, seed: int) -> list[tuple[object, int]]:
        if n <= 0:
            return []
        return self.prompt_set.sample(n, seed) if self.prompt_set is not None else draw_prompts(self.stage, n, seed)

    def make_step(self, step: int):
        s, cfg = self.stage, self.cfg
        stats, kept = self.new_stats(), []
        if self.prompt_set is not None:
            stats["epoch"] = self.prompt_set.epoch(step) / self.data_ranks  # summed over the data ranks
        for round_ in range(getattr(s, "max_rounds", 1)):
            if round_ == 0:
                # the step's prompts and sample seeds are the job's, each data rank taking its slice: every layout
                # generates the same rollouts (tests/trainer/test_stage_layouts.py)
                seed = prompt_seed(cfg.trainer.seed, 0, step)
                first = self.data_rank * self.local_prompts
                prompts = self.step_prompts(step, seed)[first:first + self.local_prompts]
                seed += first * 1009
            else:  # dynamic sampling's refills: each rank draws what it lacks, from its own stream
                seed = prompt_seed(cfg.trainer.seed, self.data_rank + 1, step, round_)
                prompts = self.refill_prompts(self.local_prompts - len(kept), seed)
            groups = self.generate(prompts, seed)
            self.score(groups)
            stats["groups_drawn"] += len(groups)
            stats["tokens_generated"] += sum(len(r.token_ids) for g in groups for r in g)
            stats["groups_zero_var"] += sum(max(r.reward for r in g) - min(r.reward for r in g) < 1e-9 for g in groups)
            if round_ == 0:
                # the step's figures are over its own prompts: the refills' number depends on how many groups were
                # dropped (more as the policy gets them all right or all wrong), which would bias them
                self.add_figures(stats, groups)
            kept += self.finish_groups(groups)
            # every rank runs the same rounds (the engine's calls are collective): the engine's own vote
            if not self.engine.lockstep.any_calls(len(kept) < self.local_prompts):
                break
        kept = kept[:self.local_prompts]
        stats["groups_kept"] = len(kept)
        rollouts = [r for g in kept for r in g]
        self.prepare(rollouts)
        return rollouts, stats

    @staticmethod
    def add_figures(stats: dict[str, float], groups: list[list[Rollout]]) -> None:
        for r in (r for group in groups for r in group):
            stats["reward_sum"] += r.reward
            stats["raw_reward_sum"] += r.raw_reward
            stats["samples"] += 1
            stats["correct"] += r.correct
            stats["len_sum"] += len(r.token_ids)
            stats[f"correct/{r.problem.env}"] += r.correct
            stats[f"count/{r.problem.env}"] += 1

    def prepare(self, rollouts: list[Rollout]) -> None:
        """Per-token inputs the loss needs beyond the advantages (distillation: none left to add here)."""


class RL(RolloutStage):
    name = "rl"
    prefix = "rl"

    def bind(self, job) -> None:
        super().bind(job)
        self.reference = None
        if self.stage.kl_coef > 0:
            if not self.cfg.checkpoint.init_from:
                raise ValueError("stage.kl_coef > 0 keeps a reference model: the weights of checkpoint.init_from, "
                                 "which is not set")
            self.reference = load_frozen(self.cfg.checkpoint.init_from, self.device, self.tokenizer_path,
                                         what="reference model", key="checkpoint.init_from")

    def verdicts(self, rollouts) -> list:
        """Each rollout's Score, every environment's rollouts scored as one batch (`Environment.score_many`: a code
        environment runs their programs in parallel sandboxes)."""
        out = [None] * len(rollouts)
        by_env: dict[str, list[int]] = {}
        for i, r in enumerate(rollouts):
            by_env.setdefault(r.problem.env, []).append(i)
        for env, idx in by_env.items():
            scores = get_env(env).score_many([rollouts[i].problem for i in idx],
                                             [self.template.decode_response(rollouts[i].token_ids) for i in idx])
            for i, v in zip(idx, scores):
                out[i] = v
        return out

    def score(self, groups):
        s = self.stage
        verdicts = iter(self.verdicts([r for group in groups for r in group]))
        for group in groups:
            for r in group:
                verdict = next(verdicts)
                r.correct = bool(verdict.correct)
                r.raw_reward = float(verdict.reward)
                r.reward = shaped_reward(r.raw_reward, r.correct, len(r.token_ids), r.effort,
                                         s.length_penalty, s.max_new_tokens)
            for r, a in zip(group, group_advantages([r.reward for r in group], s.adv_norm)):
                r.advantages = a

    def step_extra(self, tot: dict) -> dict:
        n, tokens = max(tot["samples"], 1.0), max(tot["loss/tokens"], 1.0)
        return {"rl/reward_raw": tot["raw_reward_sum"] / n,
                "rl/zero_var_share": tot["groups_zero_var"] / max(tot["groups_drawn"], 1.0),
                "rl/adv_mean": tot["loss/adv"] / tokens, "rl/adv_abs": tot["loss/adv_abs"] / tokens,
                "rl/adv_pos_share": tot["loss/adv_pos"] / tokens, "rl/ratio_dev": tot["loss/ratio_dev"] / tokens,
                **({"rl/epoch": tot["epoch"]} if "epoch" in tot else {})}

    def finish_groups(self, groups):
        """Dynamic sampling: a group whose rewards do not vary has zero advantages, no signal."""
        if not self.stage.dynamic_sampling:
            return groups
        return [g for g in groups if max(r.reward for r in g) - min(r.reward for r in g) >= 1e-9]

    def prepare(self, rollouts):
        if self.reference is None:
            return

        # the reference's log-probs of each completion token (the loss's K3 KL)
        lps = completion_logprobs(self.reference, rollouts, self.device, temperature=self.stage.temperature,
                                  pad_id=self.template.pad_id)
        for r, lp in zip(rollouts, lps):
            r.extra["ref_logprobs"] = lp

    # -- held-out evaluation -----------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float] | None:
        """Greedy completions of this rank's share of the held-out prompts at each of EVAL_EFFORTS; None when a stop
        signal came meanwhile."""
        s, cfg = self.stage, self.cfg
        problems = sample_problems(list(s.envs), s.num_eval, cfg.trainer.seed + EVAL_SEED_OFFSET,
                                   list(s.difficulty) or None)[self.data_rank::self.data_ranks]
        prompts = [(p, e) for e in EVAL_EFFORTS for p in problems]
        groups = self.generate_held_out(prompts, 0, temperature=0.0, routing=False)
        if groups is None:
            return None
        sums = []
        verdicts = self.verdicts([g[0] for g in groups])
        for k, e in enumerate(EVAL_EFFORTS):
            chunk = groups[k * len(problems):(k + 1) * len(problems)]
            ok = sum(v.correct for v in verdicts[k * len(problems):(k + 1) * len(problems)])
            sums += [float(ok), float(sum(len(g[0].token_ids) for g in chunk)), float(len(chunk))]

        sums = sum_over_data(self.job.pm, sums)
        out = {}
        for k, e in enumerate(EVAL_EFFORTS):
            ok, length, n = sums[3 * k:3 * k + 3]
            out[f"eval/success_e{e}"] = ok / max(n, 1)
            out[f"eval/len_e{e}"] = length / max(n, 1)
        out["eval/success"] = sum(out[f"eval/success_e{e}"] for e in EVAL_EFFORTS) / len(EVAL_EFFORTS)
        out["eval/prompts"] = sums[2]
        return out


class RolloutMetrics(Callback):
    """The step's rollout and loss figures (summed over data ranks) into the step's metrics record."""

    def __init__(self, stage: RolloutStage):
        self.stage = stage
        self.t0 = time.perf_counter()

    def on_step_start(self, job, step):
        self.t0 = time.perf_counter()

    def on_step_end(self, job, step, stats):
        st, loss, p = self.stage.loader.stats, self.stage._loss.step_metrics(), self.stage.prefix
        names = sorted(k for k in st if k != "generate_s")
        lnames = sorted(k for k in loss if not k.startswith("max_"))
        values = sum_over_data(job.pm, [st[k] for k in names] + [loss[k] for k in lnames])
        tot = dict(zip(names + [f"loss/{k}" for k in lnames], values))
        max_ratio, max_dev, gen_s = loss["max_ratio"], loss["max_ratio_dev"], st.get("generate_s", 0.0)
        if job.pm.meshes is not None:  # the largest over the job (generation: the slowest rank's time)
            t = torch.tensor([max_ratio, max_dev, gen_s], dtype=torch.float64, device=self.stage.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            max_ratio, max_dev, gen_s = t.tolist()
        n, tokens = max(tot["samples"], 1.0), max(tot["loss/tokens"], 1.0)
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        extra = {f"{p}/reward": tot["reward_sum"] / n, f"{p}/success": tot["correct"] / n,
                 f"{p}/response_len": tot["len_sum"] / n, f"{p}/groups_kept": tot["groups_kept"],
                 f"{p}/groups_drawn": tot["groups_drawn"], f"{p}/clip_frac": tot["loss/clipped"] / tokens,
                 f"{p}/mismatch_kl": tot["loss/mismatch_k3"] / tokens, f"{p}/max_ratio": max_ratio,
                 f"{p}/max_ratio_dev": max_dev,
                 f"{p}/entropy": tot["loss/entropy"] / tokens, f"{p}/train_tokens": tot["loss/tokens"],
                 f"{p}/rollout_tokens_per_s": tot["tokens_generated"] / max(gen_s, 1e-9),
                 f"{p}/generate_share": min(gen_s / elapsed, 1.0)}
        if getattr(self.stage.stage, "kl_coef", 0.0) > 0:
            extra[f"{p}/kl_ref"] = tot["loss/kl_ref"] / tokens
        for env in self.stage.stage.envs:
            extra[f"{p}/success/{env}"] = tot[f"correct/{env}"] / max(tot[f"count/{env}"], 1.0)
        extra.update(self.stage.step_extra(tot) if hasattr(self.stage, "step_extra") else {})
        stats.extra.update(extra)


class HeldOutEval(Callback):
    """The stage's held-out evaluation at the start, every stage.eval_every steps and at the end."""

    def __init__(self, stage: RolloutStage):
        self.stage = stage

    def _run(self, job, step):
        figures = self.stage.evaluate()
        stage_log = logging.getLogger(type(self.stage).__module__)  # trainer.stages.distill for distillation
        if figures is None:
            stage_log.info("step %d: held-out evaluation left out: %s came; the run stops with a checkpoint after "
                           "step %d", step, job.stop.name, max(step, 1))
            return
        job.metrics.log(step, figures)
        stage_log.info("step %d: %s", step, ", ".join(f"{k} {v:.4g}" for k, v in figures.items()))

    def on_train_start(self, job):
        if job.state.step == 0:
            self._run(job, 0)

    def on_step_end(self, job, step, stats):
        every = self.stage.stage.eval_every
        if (every and step % every == 0) or step == job.trainer.max_steps:
            self._run(job, step)
