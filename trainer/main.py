"""Entry point: `python -m trainer.main [hydra overrides]` (console script `cedar-train`).

Hydra composes conf/config.yaml against the schemas of trainer/config.py; the composed config becomes
typed dataclasses (every `__post_init__` check runs), then the job is built and trained. A bad config
value or an impossible set-up exits with status 2 and one line naming the key; a diverged run exits 3.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from trainer import train
from trainer.config import register_configs, to_config

register_configs()


def _fail(message: str, code: int) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)  # SystemExit passes through Hydra untouched: no traceback


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def _run(dcfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        cfg = to_config(dcfg)
        job = train.build(cfg, run_dir)
    except ValueError as e:
        _fail(str(e), 2)
    try:
        train.fit(job)
    except train.TrainingDiverged as e:
        _fail(f"training diverged: {e}", 3)
    if job.rt.rank == 0:
        wandb_dir = job.metrics.wandb_dir or "(W&B disabled)"
        print(
            f"run directory: {run_dir}\n"
            f"checkpoints:   {job.checkpointer.root}\n"
            f"metrics:       {job.metrics.path}\n"
            f"W&B files:     {wandb_dir}",
            flush=True,
        )
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    _run()


if __name__ == "__main__":
    main()
