"""The callback seam: what the training loop (trainer/train.py `train_loop`) does around each step, as objects.

Contract: a `Callback` may implement on_train_start, on_step_start, on_before_optimizer_step (finite steps only),
on_after_optimizer_step, on_step_end, on_checkpoint and on_train_end; `Callbacks` calls them in list order.
`ordered` puts `RouterBalance` (the MoE bias update) first, then the stage's callbacks and those of
`trainer.callbacks` (`load_callbacks`: "package.module:Class", built without arguments), then `MetricsLog` and
`PeriodicCheckpoint` last, so a step's record and checkpoint hold what every other callback did. Callbacks write
numbers into `stats.extra`; they run on every rank, so a collective runs on every rank at the same point.

Design and reasoning: docs/training.md#callbacks-around-the-step
"""

from __future__ import annotations

import importlib
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.metrics import memory_mb
from trainer.parallel.gradients import sum_over_data, update_router_biases
from trainer.progress import Progress

if TYPE_CHECKING:
    from trainer.train import Job, StepStats

__all__ = ["Callback", "Callbacks", "RouterBalance", "MetricsLog", "PeriodicCheckpoint", "ordered",
           "load_callbacks"]


class Callback:
    """Every hook a no-op: override the ones you need."""

    def on_train_start(self, job: Job) -> None:
        pass

    def on_step_start(self, job: Job, step: int) -> None:
        pass

    def on_before_optimizer_step(self, job: Job, step: int, stats: StepStats) -> None:
        pass

    def on_after_optimizer_step(self, job: Job, step: int, stats: StepStats) -> None:
        pass

    def on_step_end(self, job: Job, step: int, stats: StepStats) -> None:
        pass

    def on_checkpoint(self, job: Job, step: int, path: Path) -> None:
        pass

    def on_train_end(self, job: Job) -> None:
        pass


class Callbacks(Callback):
    """A list of callbacks, each hook called on each of them in order."""

    def __init__(self, callbacks: list[Callback]):
        self.callbacks = list(callbacks)

    def _each(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(*args)

    def on_train_start(self, job):
        self._each("on_train_start", job)

    def on_step_start(self, job, step):
        self._each("on_step_start", job, step)

    def on_before_optimizer_step(self, job, step, stats):
        self._each("on_before_optimizer_step", job, step, stats)

    def on_after_optimizer_step(self, job, step, stats):
        self._each("on_after_optimizer_step", job, step, stats)

    def on_step_end(self, job, step, stats):
        self._each("on_step_end", job, step, stats)

    def on_checkpoint(self, job, step, path):
        self._each("on_checkpoint", job, step, path)

    def on_train_end(self, job):
        self._each("on_train_end", job)


class RouterBalance(Callback):
    """After an applied update, move the MoE balancing biases from the step's expert loads (summed over the ranks
    that routed different tokens) and put the worst max/mean load in the metrics as `expert_imbalance`; a skipped
    step moves nothing (nan)."""

    def on_after_optimizer_step(self, job, step, stats):
        stats.extra["expert_imbalance"] = update_router_biases(job.pm) if stats.finite else math.nan


class MetricsLog(Callback):
    """Rank 0's progress (bar or plain lines) every step and a metrics record every logger.log_every steps, at the
    last step and at every skipped step: loss, lr, gradient norm, tokens/s and MFU over the window since the last
    record, tokens seen, memory, skipped shards and steps, the aux terms and every callback's `stats.extra`."""

    def __init__(self):
        self.progress = None
        self.window_tokens, self.window_start = 0, time.perf_counter()
        self._flops: dict[int, float] = {}

    def on_train_start(self, job):
        self.progress = Progress(job.rt.rank == 0, job.state.step, job.trainer.max_steps, bar=job.progress_bar,
                                 log_every=job.log_every)
        self.window_tokens, self.window_start = 0, time.perf_counter()

    def _mfu(self, job, seq_len: int, tokens_per_s: float) -> float:
        """Model FLOPs utilisation of the whole job: global tokens/s x FLOPs per token over every device's peak."""
        if seq_len not in self._flops:
            self._flops[seq_len] = job.flops_per_token(seq_len)
        return self._flops[seq_len] * tokens_per_s / (job.peak_flops * job.rt.world_size)

    def on_step_end(self, job, step, stats):
        self.window_tokens += stats.tokens
        tokens_per_s = self.window_tokens / max(time.perf_counter() - self.window_start, 1e-9)
        mfu = self._mfu(job, stats.seq_len, tokens_per_s)
        figures = {k: float(v) for k in job.stage.progress_keys
                   if (v := stats.extra.get(k, stats.aux.get(k))) is not None}
        self.progress.update(step, stats.loss, stats.lr, tokens_per_s, mfu, figures)
        if step % job.log_every == 0 or step == job.trainer.max_steps or not stats.finite:
            (skipped,) = sum_over_data(job.pm, [getattr(job.loader, "skipped_shards", 0)])
            extra = dict(stats.extra)
            record = {
                "loss": stats.loss, "lr": stats.lr, "grad_norm": stats.grad_norm, "tokens_per_s": tokens_per_s,
                "tokens_seen": job.state.tokens_seen, "mfu": mfu,
            }
            if "expert_imbalance" in extra:  # beside the throughput, where the records always had it
                record["expert_imbalance"] = extra.pop("expert_imbalance")
            record.update({"memory_mb": memory_mb(job.rt.device), "skipped_shards": int(skipped),
                           "skipped_steps": job.state.skipped_steps, **dict(sorted(stats.aux.items())), **extra})
            job.metrics.log(step, record)
            self.window_tokens, self.window_start = 0, time.perf_counter()

    def on_checkpoint(self, job, step, path):
        self.progress.write(f"checkpoint saved: {path}")
        self.window_tokens, self.window_start = 0, time.perf_counter()  # keep save time out of tokens/s

    def on_train_end(self, job):
        if self.progress is not None:
            self.progress.close()


class PeriodicCheckpoint(Callback):
    """A checkpoint every checkpoint.interval steps and at the last step; none inside a run of skipped steps (if they
    end the run, the newest checkpoint is a good step's)."""

    def on_step_end(self, job, step, stats):
        if stats.finite and job.checkpointer.due(step, job.trainer.max_steps):
            # with checkpoint.async_save the write overlaps the next steps; the last one is waited for
            job.save_checkpoint(step, wait=step >= job.trainer.max_steps)


def ordered(extra: list[Callback]) -> Callbacks:
    """The built-ins around the stage's and the user's callbacks (`extra`), in the order the module docstring gives."""
    return Callbacks([RouterBalance(), *extra, MetricsLog(), PeriodicCheckpoint()])


def load_callbacks(paths: list[str]) -> list[Callback]:
    """Instances of the callback classes named by import path ("pkg.module:Class" or "pkg.module.Class"), each
    built without arguments; a path that does not resolve to a Callback raises a ValueError naming it."""
    out = []
    for path in paths:
        module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"trainer.callbacks: cannot import {path!r} ({type(e).__name__}: {e}); give "
                             "'package.module:Class' of a trainer.callbacks.Callback subclass") from None
        instance = cls()
        if not isinstance(instance, Callback):
            raise ValueError(f"trainer.callbacks: {path!r} is not a trainer.callbacks.Callback subclass")
        out.append(instance)
    return out
