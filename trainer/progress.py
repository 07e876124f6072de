"""Human-facing progress: one tqdm bar on rank 0 (step, loss, tokens/s; tqdm supplies the ETA)."""

from __future__ import annotations

from tqdm import tqdm


class Progress:
    def __init__(self, enabled: bool, start_step: int, max_steps: int) -> None:
        self.bar = None
        if enabled:
            self.bar = tqdm(total=max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def update(self, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self.bar.update(1)

    def write(self, message: str) -> None:
        """A line above the bar (checkpoint saved, resumed, ...), without breaking it."""
        if self.bar is not None:
            self.bar.write(message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
