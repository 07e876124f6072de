"""Human-facing progress on rank 0: a tqdm bar (loss, tokens/s, MFU; tqdm supplies the ETA) when stderr is a
terminal and `logger.progress_bar` is on; otherwise (the bar off, or output going to a file such as a Slurm log)
one plain log line every `logger.log_every` steps: step, loss, lr, tokens/s, MFU and the ETA. A stage's headline
figures of the step (RL's reward and success, distillation's reverse KL, the drafter's acceptance length: its
`progress_keys`) follow the loss in both."""

from __future__ import annotations

import logging
import math
import sys
import time

from tqdm import tqdm

log = logging.getLogger("trainer.progress")


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class Progress:
    def __init__(self, enabled: bool, start_step: int, max_steps: int, *, bar: bool = True,
                 log_every: int = 1) -> None:
        """enabled: this rank reports (rank 0); bar: logger.progress_bar."""
        self.enabled, self.max_steps, self.log_every = enabled, max_steps, log_every
        self.start_step, self.start_time = start_step, time.perf_counter()
        self.first_step_end: float | None = None
        self.bar = None
        if enabled and bar and sys.stderr.isatty():
            self.bar = tqdm(total=max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def update(self, step: int, loss: float, lr: float, tokens_per_s: float, mfu: float | None,
               figures: dict[str, float] | None = None) -> None:
        """figures: the stage's headline figures of the step (name -> value), shown after the loss."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if step - self.start_step == 1:
            self.first_step_end = now
        figures = figures or {}
        if self.bar is not None:
            postfix = {"loss": f"{loss:.4f}", **{k: f"{v:.4g}" for k, v in figures.items()},
                       "tok_s": f"{tokens_per_s:,.0f}"}
            if mfu is not None:
                postfix["mfu"] = f"{100 * mfu:.1f}%"
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(1)
        elif step % self.log_every == 0 or step == self.max_steps:
            eta = self._eta(step, now)
            mfu_text = f"{100 * mfu:.2f}%" if mfu is not None else "?"
            shown = "".join(f" | {k} {v:.4g}" for k, v in figures.items())
            log.info("step %d/%d | loss %.4f%s | lr %.3e | %s tok/s | MFU %s | ETA %s", step, self.max_steps, loss,
                     shown, lr, f"{tokens_per_s:,.0f}", mfu_text, format_eta(eta))

    def _eta(self, step: int, now: float) -> float:
        """Seconds left at the pace of this launch's steps after its first, which also compiles (trainer.compile),
        warms up and allocates; the first step's own pace until there is another."""
        done = step - self.start_step
        if done > 1 and self.first_step_end is not None:
            return (now - self.first_step_end) / (done - 1) * (self.max_steps - step)
        return (now - self.start_time) / done * (self.max_steps - step) if done > 0 else math.inf

    def write(self, message: str) -> None:
        """A line above the bar (checkpoint saved, resumed, ...), without breaking it; a log line without a bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(message)
        else:
            log.info("%s", message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
