"""Supervised fine-tuning (`stage=sft`): chat samples, the loss on assistant tokens only.

Samples come from `stage.data` (JSONL or webdataset shards of {"messages": [...], "effort": e}, data/sft.py) or,
by default, are generated from the RL environments (data/envs/: problems with worked answers whose reasoning lines
grow with the effort), so the pipeline needs nothing from outside. The chat template is data/chat.py's.

Batches are one sample per row, length-bucketed (data/sft.py says why not packing); labels are -100 outside the
assistant turns, so trainer/loss.py's LMLoss normalises by the global count of assistant tokens. A held-out split
(`stage.num_eval` samples) is scored at the start, every `stage.eval_every` steps and at the end: `eval/loss`, the
mean assistant-token cross-entropy, the stage's headline figure.
"""

from __future__ import annotations

import logging
import random

import torch

from data.envs import sample_problems
from data.sft import SFTLoader, load_samples, split_samples
from trainer.batch import compute_device, local_chunk, to_device
from trainer.callbacks import Callback
from trainer.loss import LMLoss
from trainer.parallel.gradients import reduce_over
from trainer.stages.base import Stage, with_replay_cuts
from trainer.stages.common import stage_tokenizer, whole_logits

log = logging.getLogger(__name__)

__all__ = ["SFT", "env_samples", "eval_lm_loss"]


def env_samples(envs: list[str], n: int, seed: int, difficulty: list[int], effort: list[int]) -> list[dict]:
    """n chat samples generated from `envs`: the problem as the user turn, its worked answer at a drawn effort as the
    assistant's."""
    rng = random.Random(seed)
    problems = sample_problems(list(envs), n, seed, list(difficulty) or None)
    out = []
    for p in problems:
        e = rng.randint(effort[0], effort[1])
        out.append({"messages": [{"role": "user", "content": p.prompt},
                                 {"role": "assistant", "content": p.worked(e)}], "effort": e})
    return out


@torch.no_grad()
def eval_lm_loss(job, batches: list[dict]) -> float:
    """Mean cross-entropy over the valid labels of `batches` (this data rank's share of a held-out set), summed over
    every rank that holds different tokens: a scoring forward in eval mode (no balancing counts)."""
    pm = job.pm
    device, module = compute_device(pm), pm.module
    total, count = 0.0, 0.0
    was = module.training
    module.eval()
    try:
        for batch in batches:
            ids, labels, mask, _ = to_device(batch, device)
            ids, labels, mask = local_chunk(pm, ids, labels, mask)
            with torch.autocast(device.type, dtype=job.rt.autocast_dtype or torch.float32,
                                enabled=job.rt.autocast_dtype is not None):
                logits = whole_logits(module(ids, image_mask=mask)).float()
            ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                   reduction="sum")
            total += float(ce)
            count += float((labels != -100).sum())
    finally:
        module.train(was)
    total, count = reduce_over(pm, [total, count], "dp_ep_cp", mean=False)
    return total / max(count, 1.0)


class HeldOutLoss(Callback):
    """`eval/loss` on the held-out samples at the start, every stage.eval_every steps and at the end."""

    def __init__(self, stage: "SFT"):
        self.stage = stage

    def _eval(self, job, step: int) -> None:
        if job.pm.pipeline is not None:
            if step == job.state.step:
                log.warning("stage=sft: the held-out loss is not computed under pipeline parallelism (parallel.pp > 1)")
            return
        if job.stop is not None and job.stop.agreed(job.rt.distributed):  # its checkpoint first
            log.info("step %d: held-out loss left out: %s came; the run stops with a checkpoint after step %d", step,
                     job.stop.name, max(step, 1))
            return
        loss = eval_lm_loss(job, self.stage.held_out_batches)
        job.metrics.log(step, {"eval/loss": loss})
        log.info("step %d: held-out assistant-token loss %.4f", step, loss)

    def on_train_start(self, job):
        if job.state.step == 0:
            self._eval(job, 0)

    def on_step_end(self, job, step, stats):
        data = getattr(job.loader, "stats", None)  # this data rank's loader (data/sft.py)
        if isinstance(data, dict):
            stats.extra["sft/padding_share"] = data["padding_share"]
            stats.extra["sft/assistant_share"] = data["assistant_share"]
            stats.extra["sft/skipped_samples"] = sum(data["skipped"].values())
        every = self.stage.stage.eval_every
        if (every and step % every == 0) or step == job.trainer.max_steps:
            self._eval(job, step)


class SFT(Stage):
    name = "sft"

    def __init__(self, stage):
        self.stage = stage
        self.held_out_batches: list[dict] = []
        self.skipped: dict[str, int] = {}

    def samples(self, cfg, template) -> tuple[list[dict] | str, list[dict]]:
        """(the training samples or their source, the held-out samples)."""
        s = self.stage
        if s.data:
            samples, self.skipped = load_samples(s.data)
            return split_samples(samples, s.num_eval, cfg.trainer.seed)
        train = env_samples(s.envs, s.num_samples, cfg.trainer.seed, s.difficulty, s.effort)
        # the held-out problems come from a seed the training samples never use
        held = env_samples(s.envs, s.num_eval, cfg.trainer.seed + 7_919_000, s.difficulty, s.effort)
        return train, held

    def batches(self, cfg, data_rank: int, data_ranks: int, *, progress: bool = False):
        template, info = stage_tokenizer(cfg, progress=progress)
        self.template = template
        train, held = self.samples(cfg, template)
        # pipeline schedules and context-parallel chunks need one sequence length for every batch
        kw = dict(seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size, data_rank=data_rank, data_ranks=data_ranks,
                  fixed_length=self.stage.fixed_length or cfg.parallel.pp > 1 or cfg.parallel.cp > 1,
                  bucket_size=self.stage.bucket_size * cfg.data.batch_size * data_ranks)
        loader = SFTLoader(train, template, seed=cfg.trainer.seed, skipped=self.skipped, **kw)
        eval_loader = SFTLoader(held, template, seed=0, **kw)
        n_eval = max(1, len(held) // (cfg.data.batch_size * data_ranks))  # one pass over the held-out samples
        self.held_out_batches = [b for _, b in zip(range(n_eval), iter(eval_loader))]
        return with_replay_cuts(loader, self.stage, cfg), info

    def loss(self):
        return LMLoss()

    def callbacks(self):
        return [HeldOutLoss(self)]
