"""Entry point: `python -m trainer.cli.main [hydra overrides]` (console script `cedar-train`).

Hydra composes conf/config.yaml against the schemas of trainer/config.py; the composed config becomes
typed dataclasses (every `__post_init__` check runs), then the job is built and trained. Exit status and output:
- 0: trained to trainer.max_steps; or stopped by SIGTERM / SIGUSR1 after saving a checkpoint (one line says so); or
  the resumed run had already reached trainer.max_steps (one line says so);
- 2: a mistyped config group option, a bad config value, an impossible set-up, a missing file or a run directory in use or not writable: one line
  naming the key or the path; a run directory this launch created is removed again (nothing of a run is in it);
- 3: trainer.max_bad_steps non-finite steps in a row;
- 4: a checkpoint could not be saved (no space left, an I/O error): one line naming the cause and the path; the
  previous checkpoint stays the one a resume starts from.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import hydra
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from torch.distributed import distributed_c10d

from trainer import train
from trainer.checkpoint import CheckpointSaveError
from trainer.cli.app import io_message, leave_together
from trainer.compose import CONF_DIR, check_config_groups, compose, hydra_overrides, sweep_variants
from trainer.config import register_configs, to_config
from trainer.preemption import StopRequest
from trainer.run_lock import RunLock

register_configs()


def _first_to_say(message: str) -> bool:
    """Whether this rank prints `message`: under torchrun every rank that fails the same way (a missing data.path)
    would print the same line, so only the first one to claim it on the launcher's store does; a rank with a message
    of its own prints it. True outside a process group, or when the store cannot say."""
    if not dist.is_initialized():
        return True
    try:
        mine = str(dist.get_rank())
        key = "cedar_error/" + hashlib.sha1(message.encode()).hexdigest()
        return distributed_c10d._get_default_store().compare_set(key, "", mine).decode() == mine
    except (RuntimeError, ValueError):
        return True


def _fail(message: str, code: int) -> None:
    if _first_to_say(message):
        print(f"error: {message}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)  # SystemExit passes through Hydra untouched: no traceback


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def _run(dcfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    stop = None
    try:
        cfg = to_config(dcfg)
        # Before the set-up, which can take minutes: a stop signal that comes meanwhile ends the run after its first
        # step, with a checkpoint, instead of killing it (launchers keep the signals pending until here).
        stop = StopRequest(cfg.trainer.stop_deadline_s).install()
        job = train.build(cfg, run_dir)
    except (ValueError, OSError) as e:  # a bad value; a missing or unreadable file the set-up needs
        if stop is not None:
            stop.uninstall()
        RunLock.discard_dir(run_dir)  # a failed start-up leaves no run directory of its own behind
        _fail(str(e) if isinstance(e, ValueError) else io_message(e), 2)
    try:
        outcome = train.fit(job, stop)
    except train.TrainingDiverged as e:
        _fail(f"training diverged: {e}", 3)
    except CheckpointSaveError as e:
        _fail(str(e), 4)
    if job.rt.rank == 0:
        step, max_steps = job.state.step, job.trainer.max_steps
        if outcome == "already_finished":
            print(f"nothing to do: the run in {run_dir} already reached trainer.max_steps={max_steps} (resumed at "
                  f"step {step}); raise trainer.max_steps to train on, or pick a new hydra.run.dir", flush=True)
        elif outcome == "stopped":
            print(f"stopped by {job.stop.name} at step {step}/{max_steps}: checkpoint saved at {job.last_checkpoint}; "
                  f"launch again with hydra.run.dir={run_dir} (checkpoint.resume=auto) to continue", flush=True)
        wandb_dir = job.metrics.wandb_dir or ("(none: nothing to do)" if outcome == "already_finished"
                                              else "(W&B disabled)")
        print(
            f"run directory: {run_dir}\n"
            f"checkpoints:   {job.checkpointer.root}\n"
            f"metrics:       {job.metrics.path}\n"
            f"W&B files:     {wandb_dir}",
            flush=True,
        )
    if dist.is_initialized():
        leave_together()
        dist.destroy_process_group()
    RunLock.release_dir(run_dir)  # a multirun's next job may run in this process


def main() -> None:
    # Hydra's runner reports a mistyped group option (model=v41_tinny), a misspelled key or a wrong type before _run,
    # in a dozen lines: compose first, for one line naming the key (and the closest valid one) and exit status 2; a -m
    # sweep, each value it sweeps (compose.sweep_variants).
    try:
        check_config_groups(sys.argv[1:])
        overrides = hydra_overrides(sys.argv[1:])
        for variant in [overrides] if overrides is not None else sweep_variants(sys.argv[1:]) or []:
            compose(variant)
    except ValueError as e:
        _fail(str(e), 2)
    _run()


if __name__ == "__main__":
    main()
