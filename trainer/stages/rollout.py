"""Rollout batches: prompts from the environments, G samples each with the engine, scored, turned into training
micro-batches. Shared by RL (trainer/stages/rl.py: rewards, group advantages) and on-policy distillation
(trainer/stages/distill.py: a teacher's per-token log-probs).

Contract: each data rank generates for its own prompts with the training model itself, in eval mode, from seeds
derived from (trainer.seed, data rank, step, round), so a resumed run regenerates the same rollouts. Micro-batches
are padded to data.seq_len; labels are the completion's tokens (-100 elsewhere) and carry the advantage, the
engine's log-prob and, with stage.replay_routing, its routing records.

Design and reasoning: docs/stages.md#rollout-batches
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

import torch

from data.envs import sample_problems
from model.replay import ReplayCuts
from model.routing import RoutingRecords
from trainer.engine import Request
from trainer.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

__all__ = ["Rollout", "RolloutBatches", "PromptSet", "draw_prompts", "engine_replay", "prompt_seed",
           "stratified_efforts"]


def prompt_seed(seed: int, data_rank: int, step: int, round_: int = 0) -> int:
    return (seed * 1_000_003 + data_rank * 7_919 + step * 104_729 + round_ * 15_485_863) % (2**62)


def engine_replay(stage) -> str:
    """The engine's prefill mode: stage.rollout_replay, with `auto` = bounded replay (window) when the
    bounded-replay hook is on, else the exact halo prefill."""
    if stage.rollout_replay != "auto":
        return stage.rollout_replay
    return "window" if stage.bounded_replay_sim else "halo"


@dataclass
class Rollout:
    """One sampled completion, scored."""

    problem: object
    effort: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    routing: object = None
    reward: float = 0.0
    raw_reward: float = 0.0  # RL: the environment's reward before the effort's length discount
    correct: bool = False
    advantages: list[float] | float = 0.0  # per token, or one per sequence
    extra: dict = field(default_factory=dict)


class RolloutBatches:
    """The loader of a rollout stage: an infinite iterator of micro-batches, grad_accum of them per optimiser step.
    `make_step(step)` (the stage's) returns the step's scored rollouts; `bind(job)` gives it the model."""

    skipped_shards = 0

    def __init__(self, make_step, *, grad_accum: int, pad_id: int, temperature: float, replay_routing: bool,
                 replay_cut: bool, seq_len: int | None = None):
        self.make_step, self.grad_accum, self.pad_id, self.seq_len = make_step, grad_accum, pad_id, seq_len
        self.temperature, self.replay_routing, self.replay_cut = temperature, replay_routing, replay_cut
        self.step = 0  # rollouts made
        self.pending: list[dict] = []
        self.stats: dict[str, float] = {}

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if not self.pending:
            t0 = time.perf_counter()
            rollouts, self.stats = self.make_step(self.step)
            self.step += 1
            self.pending = self.micro_batches(rollouts)
            self.stats["generate_s"] = time.perf_counter() - t0
        return self.pending.pop(0)

    def state_dict(self) -> dict:
        return {"step": self.step, "pending": self.pending}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.pending = int(state["step"]), list(state["pending"])

    # -- micro-batches -----------------------------------------------------------------------------------------------
    def micro_batches(self, rollouts: list[Rollout]) -> list[dict]:
        """grad_accum micro-batches over the rollouts (sorted by length, dealt round-robin so they are alike); one
        without rollouts (a rank whose groups were all dropped) holds a single ignored row, so every rank still runs
        the same forwards and collectives."""
        order = sorted(range(len(rollouts)), key=lambda i: len(rollouts[i].prompt_ids) + len(rollouts[i].token_ids))
        parts = [[rollouts[i] for i in order[m::self.grad_accum]] for m in range(self.grad_accum)]
        return [self.collate(p) for p in parts]

    def collate(self, rollouts: list[Rollout]) -> dict:
        if not rollouts:
            T = self.seq_len or 8
            return {"input_ids": torch.full((1, T), self.pad_id, dtype=torch.long),
                    "labels": torch.full((1, T), -100, dtype=torch.long),
                    "advantages": torch.zeros(1, T), "rollout_logprobs": torch.zeros(1, T)}
        T = max(len(r.prompt_ids) + len(r.token_ids) - 1 for r in rollouts)
        if self.seq_len is not None:  # one shape every step (and pads alike in every layout: the MoE balance sees them)
            T = self.seq_len
        B = len(rollouts)
        ids, labels = sequences(rollouts, T, self.pad_id)
        adv, lp = torch.zeros(B, T), torch.zeros(B, T)
        cuts = torch.full((B,), -1, dtype=torch.long)
        for b, r in enumerate(rollouts):
            n, p = len(r.prompt_ids) + len(r.token_ids) - 1, len(r.prompt_ids)
            a = r.advantages
            adv[b, p - 1:n] = torch.tensor(a) if isinstance(a, list) else float(a)
            lp[b, p - 1:n] = torch.tensor(r.logprobs)
            cuts[b] = p
        batch = {"input_ids": ids, "labels": labels, "advantages": adv, "rollout_logprobs": lp}
        for key in rollouts[0].extra:  # per-token extras a stage adds: a number or a row (distillation's teacher
            first = torch.as_tensor(rollouts[0].extra[key])  # log-softmax) per completion token
            t = torch.zeros(B, T, *first.shape[1:])
            for b, r in enumerate(rollouts):
                p, n = len(r.prompt_ids), len(r.prompt_ids) + len(r.token_ids) - 1
                t[b, p - 1:n] = torch.as_tensor(r.extra[key])
            batch[key] = t
        if self.replay_routing and rollouts[0].routing is not None:
            batch["routing"] = RoutingRecords.cat([_pad_records(r.routing, T) for r in rollouts], dim=0)
        if self.replay_cut:
            batch["replay_cuts"] = ReplayCuts(decoder=cuts)
        return batch


def sequences(rollouts: list[Rollout], T: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training inputs of the rollouts: input_ids [B, T] (prompt + completion but its last token, then pad_id) and
    labels [B, T] (the completion's tokens where they are predicted, -100 elsewhere)."""
    B = len(rollouts)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    labels = torch.full((B, T), -100, dtype=torch.long)
    for b, r in enumerate(rollouts):
        seq = r.prompt_ids + r.token_ids
        ids[b, :len(seq) - 1] = torch.tensor(seq[:-1])
        labels[b, len(r.prompt_ids) - 1:len(seq) - 1] = torch.tensor(r.token_ids)
    return ids, labels


def _pad_records(rec, T: int):
    """Routing records padded (-1: the forward chooses) or cut to T tokens."""

    def fit(t):
        n = t.shape[1]
        if n >= T:
            return t[:, :T]
        return torch.nn.functional.pad(t, (0, 0, 0, T - n), value=-1)

    return RoutingRecords({k: fit(v) for k, v in rec.topk.items()}, {k: fit(v) for k, v in rec.experts.items()})


def generate_groups(engine, template, problems_efforts: list[tuple[object, int]], *, group_size: int,
                    max_new_tokens: int, temperature: float, seed: int, return_routing: bool) -> list[list[Rollout]]:
    """G completions per (problem, effort), each sample with its own seed; groups in the order given."""
    requests, prompts = [], []
    for i, (problem, effort) in enumerate(problems_efforts):
        ids = template.render_prompt(problem.prompt, effort)
        prompts.append(ids)
        for g in range(group_size):
            sp = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                                stop_token_ids=[template.end_id], seed=(seed + i * 1009 + g) % (2**62))
            requests.append(Request(ids, sp, effort=effort, request_id=(i, g), return_routing=return_routing))
    module = engine.model
    was = module.training
    module.eval()
    try:
        completions = engine.generate(requests)
    finally:
        module.train(was)
    groups: list[list[Rollout]] = [[] for _ in problems_efforts]
    for req, c in zip(requests, completions):
        if c.error is not None:
            raise RuntimeError(f"rollout failed: {c.error}")
        i, _ = req.request_id
        problem, effort = problems_efforts[i]
        groups[i].append(Rollout(problem, effort, prompts[i], list(c.token_ids), list(c.logprobs), c.routing))
    return groups


def draw_prompts(stage, n: int, seed: int) -> list[tuple[object, int]]:
    """n (problem, effort) pairs from the stage's environments, levels and effort range, stratified: the levels
    dealt evenly and the efforts one uniform draw from each of n equal slices of the range (shuffled), so any n
    prompts drawn hold the same mix of difficulties and efforts and the per-step reward does not swing with it."""
    rng = random.Random(seed)
    problems = sample_problems(list(stage.envs), n, seed, list(stage.difficulty) or None, stratify=True)
    return list(zip(problems, stratified_efforts(rng, stage.effort[0], stage.effort[1], n)))


def stratified_efforts(rng: random.Random, low: int, high: int, n: int) -> list[int]:
    """n integers of [low, high]: one uniform draw from each of n equal slices of the range, in a shuffled order."""
    width = (high - low + 1) / max(n, 1)
    out = [min(high, low + int((i + rng.random()) * width)) for i in range(n)]
    rng.shuffle(out)
    return out


class PromptSet:
    """A fixed training set of prompts (stage.train_prompts of them, drawn once with `draw_prompts` from `seed`),
    visited in epochs: each epoch a fresh shuffle, a step taking the next `per_step` prompts of the epochs laid end
    to end. RL on a training set, as RL setups on a dataset do: the training reward of an epoch is measured over the
    same prompts as the one before, so its trend is the policy's and not the draw's; held-out prompts (a seed these
    never use) measure what carries over, where the environment has many more problems than the two draws: at
    arithmetic's level 1 (~100 problems) half the held-out draws are training problems (BENCHMARKS.md, issue 42,
    session 26)."""

    def __init__(self, stage, size: int, seed: int, per_step: int):
        self.prompts, self.seed, self.per_step = draw_prompts(stage, size, seed), seed, per_step

    def epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 31 + epoch).shuffle(order)
        return order

    def step_prompts(self, step: int) -> list[tuple[object, int]]:
        """The step's prompts (a step may straddle two epochs)."""
        n, out, pos = len(self.prompts), [], step * self.per_step
        while len(out) < self.per_step:
            epoch, i = divmod(pos, n)
            take = min(self.per_step - len(out), n - i)
            out += [self.prompts[k] for k in self.epoch_order(epoch)[i:i + take]]
            pos += take
        return out

    def epoch(self, step: int) -> float:
        """Epochs completed at the start of `step` (fractional)."""
        return step * self.per_step / len(self.prompts)

    def sample(self, n: int, seed: int) -> list[tuple[object, int]]:
        """n prompts of the set drawn at random (dynamic sampling's refills)."""
        rng = random.Random(seed)
        return [self.prompts[rng.randrange(len(self.prompts))] for _ in range(n)]
