"""What a checkpoint save costs the training steps, blocking vs asynchronous (checkpoint.async_save), in one process.

    python bench/checkpoint_save.py [--model v41_tiny] [--batch-size 8] [--seq-len 128] [--steps 6] [--threads 1]
                                    [--device cpu|cuda] [--dir DIR]

Builds the model and AdamW as the trainer does (one process), trains `--steps` steps as a baseline, then per mode
saves a checkpoint of the trainer's states (weights, optimiser moments, schedule; trainer/checkpoint/checkpointer.py) and trains
`--steps` more: the time the save blocks the step (blocking: the whole write; asynchronous: the copy of the state to
host memory), the mean step time while the background write runs, the extra wait to complete it at the end (none if
it finished). A save costs the training its blocking time and the wait, plus the steps' slowdown over the baseline
while the write runs. Modes: blocking; async fresh (checkpoint.async_staging=fresh: new pageable host buffers each
save); async reused (the default: host buffers taken at the first save, page-locked on a GPU) and again reused (its
second save, into the same buffers: what every later save of a run costs).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="v41_tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (bf16 autocast, the state on the device)")
    p.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary directory)")
    args = p.parse_args()
    from optim.builder import build_optimizer
    from optim.config import OptimConfig
    from optim.schedule import LRScheduler
    from tests.helpers import load_config
    from trainer.checkpoint import Checkpointer, TrainState
    from trainer.config import CheckpointConfig, ParallelConfig, TrainerConfig
    from trainer.train import build_model, compute_gradients, setup_runtime, trainable_parameters

    cfg = load_config(args.model)
    parallel = ParallelConfig()
    cuda = args.device == "cuda"
    rt = setup_runtime(TrainerConfig(device=args.device, precision="bf16" if cuda else "fp32",
                                     num_threads=args.threads), parallel)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    pm = build_model(cfg, rt, parallel, 0, batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=1)
    params = trainable_parameters(pm.module, cfg)
    opt = build_optimizer(params, OptimConfig(lr=3e-4, warmup_steps=0))
    state = TrainState(pm.module, opt, LRScheduler(opt, OptimConfig(lr=3e-4, warmup_steps=0), total_steps=1000))
    gen = torch.Generator().manual_seed(0)

    def step(i: int) -> float:
        t = time.perf_counter()
        ids = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=gen)
        compute_gradients(pm, [{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}], params, 1.0, rt.autocast_dtype,
                          step=i)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t

    work = Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir))
    n_bytes = sum(v.numel() * v.element_size() for v in pm.module.state_dict().values())
    for i in range(2):  # warm-up, and the optimiser's state exists
        step(i)
    base = [step(i) for i in range(args.steps)]
    base_ms = 1e3 * sum(base) / len(base)
    rows = []
    # async fresh: new host buffers each save; async reused: buffers from the first save kept (page-locked on a
    # GPU), so its second save is what every later save of a run costs
    checkpointers = {}
    for mode in ("blocking", "async fresh", "async reused", "again reused"):
        staging = mode.split()[-1] if mode != "blocking" else "reused"
        ck = checkpointers.setdefault(staging if mode != "blocking" else mode, Checkpointer(
            work / mode.replace(" ", "_"), CheckpointConfig(async_save=mode != "blocking", async_staging=staging), 0,
            info={"model": dataclasses.asdict(cfg)}))
        sync()
        t = time.perf_counter()
        ck.save(1 + len(rows), {"train": state}, wait=mode == "blocking")
        sync()
        blocked = time.perf_counter() - t
        during, finished_at = [], None
        for i in range(args.steps):
            during.append(step(i))
            if ck.pending is not None and ck.poll() is not None:
                finished_at = i + 1
        t = time.perf_counter()
        ck.finish()
        wait = time.perf_counter() - t
        mean_ms = 1e3 * sum(during) / len(during)
        rows.append((mode, blocked * 1e3, mean_ms, finished_at, wait * 1e3))
    print(f"{args.model}: {n_bytes / 2**20:.1f} MiB of weights (+ AdamW's two moments), {args.batch_size} x "
          f"{args.seq_len} tokens, {args.device}, {torch.get_num_threads()} thread(s); baseline step {base_ms:.1f} ms "
          f"(mean of {args.steps})")
    print(f"{'save':13s} {'blocks (ms)':>12s} {'steps after (ms)':>17s} {'vs baseline':>12s} {'done after':>11s} "
          f"{'wait (ms)':>10s}")
    for mode, blocked, mean_ms, finished_at, wait in rows:
        done = "-" if finished_at is None else f"{finished_at} steps"
        print(f"{mode:13s} {blocked:12.1f} {mean_ms:17.1f} {mean_ms / base_ms - 1:+11.1%} {done:>11s} {wait:10.1f}")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
