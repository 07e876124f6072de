"""Metrics: one logger interface with two sinks (metrics.jsonl in the run directory, and W&B), written by
rank 0 only; plus the measurements behind the numbers (device peak FLOP/s for MFU, memory).

MFU = model.flops_per_token(seq_len) * tokens/s / (peak FLOP/s per device * devices). GPU peaks are the
dense bf16 tensor-core figures from the vendors' data sheets. A CPU has no such figure that means much
for PyTorch, so its peak is measured once at start-up: the best of a few fp32 1024^3 matmuls using the
threads this process runs with (on the 2-core development machine this is roughly 50-150 GFLOP/s). MFU on
CPU is therefore "fraction of what this machine's GEMM reaches", a useful trend, not a hardware ratio.
"""

from __future__ import annotations

import json
import math
import os
import resource
import secrets
import time
from pathlib import Path

import torch

from trainer.config import WandbConfig

# Dense bf16 peak FLOP/s (no sparsity) by device-name fragment, most specific first.
_GPU_PEAK_BF16 = (
    ("H200", 989.5e12),
    ("H100", 989.5e12),
    ("H800", 989.5e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
)


def measure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32, size: int = 1024,
                         repeats: int = 3) -> float:
    """Best observed FLOP/s of a size^3 matmul on `device` over `repeats` timed runs after one warm-up."""
    a = torch.randn(size, size, device=device, dtype=dtype, generator=None)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first run pays for allocation and thread start-up
            best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def device_peak_flops(device: torch.device, override: float = 0.0) -> float:
    if override > 0:
        return override
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, peak in _GPU_PEAK_BF16:
            if fragment in name:
                return peak
        return measure_matmul_flops(device, torch.bfloat16, size=4096)
    # CPU: measured without touching the global RNG stream that training draws from
    with torch.random.fork_rng(devices=[]):
        return measure_matmul_flops(device)


def memory_mb(device: torch.device) -> float:
    """GPU: peak allocated by the caching allocator; CPU: resident set size of this process."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # not Linux: peak RSS (kilobytes on Linux, bytes on macOS; close enough for a trend)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


class MetricsLogger:
    """`log(step, metrics)` appends one JSON object to metrics.jsonl and logs the same numbers to W&B.

    Built on every rank; only rank 0 writes. On resume, records after the resumed step are dropped from
    metrics.jsonl first, so the file reads as one run whatever crashed in between.
    """

    def __init__(self, run_dir: Path, wandb_cfg: WandbConfig, rank: int, config: dict | None = None) -> None:
        self.enabled = rank == 0
        self.path = Path(run_dir) / "metrics.jsonl"
        self.run_dir = Path(run_dir)
        self.wandb_run = None
        self.wandb_dir: Path | None = None
        if self.enabled and wandb_cfg.mode != "disabled":
            self.wandb_run = self._init_wandb(wandb_cfg, config or {})

    def _init_wandb(self, cfg: WandbConfig, config: dict):
        import wandb

        # Keep every W&B file inside the run directory, and reuse one run id across resumes.
        os.environ.setdefault("WANDB_SILENT", "true")
        os.environ["WANDB_DIR"] = str(self.run_dir)
        id_file = self.run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id)
        run = wandb.init(
            mode=cfg.mode,
            dir=str(self.run_dir),
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or self.run_dir.name,
            tags=list(cfg.tags),
            id=run_id,
            resume="allow",
            config=config,
            # the W&B service starts a helper process; on a loaded 2-core machine the default 90 s can run out
            settings=wandb.Settings(init_timeout=300),
        )
        self.wandb_dir = Path(run.dir).parent  # <run dir>/wandb/<offline-run-...>/
        return run

    def truncate_after(self, step: int) -> None:
        if not self.enabled or not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in keep))

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        # strict JSON: a skipped step's NaN / Inf loss is written as null (W&B gets the float)
        record = {"step": step, **{k: None if isinstance(v, float) and not math.isfinite(v) else v
                                   for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
