"""The pretraining loop and the set-up around it.

`build(cfg, run_dir)` turns the validated job config into a `Job` (runtime, model, optimiser, scheduler,
data, checkpointer, metrics), resuming from a checkpoint when `checkpoint.resume` finds one; `fit(job)`
runs `train_loop` and closes what `build` opened. Each builder receives only its own config section.

Order of set-up (STYLE.md): build the model on the meta device, materialise it with `to_empty` on the
training device, then `init_weights()` from the same seed on every rank (replicas start identical).
Plain data parallelism: every rank runs the full model on its own data and gradients are averaged with
one all-reduce per step; MoE load counts are summed across ranks before the bias update, so the
balancing biases stay identical too.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import model as model_pkg
from data.config import build_dataloader, ensure_prepared
from model.config import ModelConfig
from optim import LRScheduler, build_optimizer
from trainer.checkpoint import Checkpointer, RankLocalState, TrainState
from trainer.config import Config, ParallelConfig, ParallelDims, StageConfig, TrainerConfig
from trainer.metrics import MetricsLogger, device_peak_flops, memory_mb
from trainer.progress import Progress

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm stopped being finite; nothing of that step is applied or saved."""


@dataclass
class Runtime:
    """Where this process runs: its rank, device, precision and the validated parallel sizes."""

    rank: int
    world_size: int
    device: torch.device
    autocast_dtype: torch.dtype | None  # None: plain fp32
    dims: ParallelDims

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def setup_runtime(cfg: TrainerConfig, parallel: ParallelConfig) -> Runtime:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dims = parallel.resolve(world_size)
    kind = cfg.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("trainer.device=cuda but no CUDA device is available")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(cfg.num_threads or max(1, (os.cpu_count() or 1) // local_world))
    if rank != 0:  # one voice per job: the other ranks log warnings and errors only
        logging.getLogger().setLevel(logging.WARNING)
    precision = cfg.precision if cfg.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return Runtime(rank, world_size, device, torch.bfloat16 if precision == "bf16" else None, dims)


def apply_stage_hooks(model_cfg: ModelConfig, stage: StageConfig) -> ModelConfig:
    """Stage switches that change what the model computes (SPEC 2: post-training hooks)."""
    if stage.name != "pretrain":
        raise ValueError(f"stage.name={stage.name!r} is not implemented yet; only 'pretrain' runs")
    if stage.bounded_replay:
        raise ValueError("stage.bounded_replay=true needs the model's replay simulation, which is not there yet")
    if stage.fp4_qat:  # FP4 fake-quant of the main KV in every forward (SPEC 1.4)
        quant = dataclasses.replace(model_cfg.quant, main_kv="fp4")
        model_cfg = dataclasses.replace(model_cfg, quant=quant)
    return model_cfg


def build_model(cfg: ModelConfig, device: torch.device, seed: int) -> torch.nn.Module:
    with torch.device("meta"):
        model = model_pkg.build(cfg)
    model.to_empty(device=device)
    torch.manual_seed(seed)  # same weights on every rank
    with torch.no_grad():
        model.init_weights()
    return model


def install_canonical_vocab(model: torch.nn.Module, cfg: ModelConfig, tokenizer_path: str) -> None:
    """Engram hashes canonical ids (REFERENCE A8): derive the map from the tokenizer the shards were made with.
    It is a pure function of the tokenizer, so a resumed run recomputes the same map."""
    if not cfg.engram.layers:
        return
    from data.tokenizer import load_tokenizer
    from model.engram import canonical_vocab_from_tokenizer

    mapping, num_canonical = canonical_vocab_from_tokenizer(load_tokenizer(tokenizer_path), cfg.vocab_size)
    if num_canonical > cfg.engram.compressed_vocab_size:
        raise ValueError(
            f"model.engram.compressed_vocab_size={cfg.engram.compressed_vocab_size} is smaller than the "
            f"{num_canonical} canonical ids of tokenizer {tokenizer_path}"
        )
    model.set_canonical_vocab(mapping)


def freeze_all_but(model: torch.nn.Module, trainable: list[torch.nn.Parameter]) -> None:
    """requires_grad only on what the optimiser owns (e.g. the indexers in the dense warm-up phase), so
    backward computes no gradient that would never be used."""
    keep = {id(p) for p in trainable}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class Job:
    """Everything the loop touches, built once by `build`."""

    rt: Runtime
    trainer: TrainerConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    state: TrainState
    loader: object
    checkpointer: Checkpointer
    ckpt_states: dict
    metrics: MetricsLogger
    log_every: int
    progress_bar: bool
    peak_flops: float
    run_dir: Path
    batches: object = None  # the live iterator over `loader`


def build(cfg: Config, run_dir: Path) -> Job:
    rt = setup_runtime(cfg.trainer, cfg.parallel)
    model_cfg = apply_stage_hooks(cfg.model, cfg.stage)
    ensure_prepared(cfg.data, progress=rt.rank == 0)  # node-safe: one process prepares, the others wait
    loader, tokenizer = build_dataloader(cfg.data, rt.rank, rt.dims.dp)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(
            f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size} ids "
            f"({tokenizer.path})"
        )
    model = build_model(model_cfg, rt.device, cfg.trainer.seed)
    install_canonical_vocab(model, model_cfg, tokenizer.path)
    trainable = list(model.trainable_parameters())
    freeze_all_but(model, trainable)
    optimizer = build_optimizer(trainable, cfg.optim)
    scheduler = LRScheduler(optimizer, cfg.optim, total_steps=cfg.trainer.max_steps)
    state = TrainState(model, optimizer, scheduler)
    ckpt_states = {"train": state, "rank_local": RankLocalState(loader, rt.rank)}
    checkpointer = Checkpointer(run_dir / "checkpoints", cfg.checkpoint, rt.rank)
    seed_everything(cfg.trainer.seed + rt.rank)  # anything random after init differs per rank
    metrics = MetricsLogger(run_dir, cfg.logger.wandb, rt.rank, config=dataclasses.asdict(cfg))
    resume_from = checkpointer.resume_path()
    if resume_from is not None:
        checkpointer.load(resume_from, ckpt_states)
        metrics.truncate_after(state.step)
        log.info("resumed from %s at step %d", resume_from, state.step)
    return Job(
        rt=rt, trainer=cfg.trainer, model=model, optimizer=optimizer, scheduler=scheduler, state=state,
        loader=loader, checkpointer=checkpointer, ckpt_states=ckpt_states, metrics=metrics,
        log_every=cfg.logger.log_every, progress_bar=cfg.logger.progress_bar,
        peak_flops=device_peak_flops(rt.device, cfg.trainer.peak_flops), run_dir=run_dir,
    )


def _to_device(batch: dict, device: torch.device):
    """A loader batch -> (input_ids [B, T], labels [B, T], image_mask [B, T] or None) on `device`."""
    mask = batch.get("image_mask")
    return (
        batch["input_ids"].to(device, non_blocking=True),
        batch["labels"].to(device, non_blocking=True),
        None if mask is None else mask.to(device, non_blocking=True),
    )


@dataclass
class MicroBatches:
    """What one optimiser step's micro-batches produced on this rank."""

    loss: torch.Tensor  # mean LM loss, detached
    aux: dict[str, float]  # means of "aux/<name>" (weighted terms added to the loss), "aux_metric/<name>" (raw)
    tokens: int  # input tokens processed
    seq_len: int


def forward_backward(job: Job) -> MicroBatches:
    """Forward and backward over trainer.grad_accum micro-batches; gradients accumulate in .grad."""
    accum, dtype = job.trainer.grad_accum, job.rt.autocast_dtype
    loss_sum, aux_sums, tokens = torch.zeros((), device=job.rt.device), {}, 0
    for _ in range(accum):
        input_ids, labels, image_mask = _to_device(next(job.batches), job.rt.device)
        with torch.autocast(job.rt.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits, aux = job.model(input_ids, image_mask=image_mask, return_aux=True)
        lm_loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        raw = aux.pop("metrics", {})
        # each micro-batch's loss is divided by accum so the accumulated gradient is the mean over micro-batches
        ((lm_loss + sum(aux.values())) / accum).backward()
        loss_sum += lm_loss.detach()
        values = {f"aux/{k}": float(v.detach()) for k, v in aux.items()}
        values.update({f"aux_metric/{k}": v for k, v in raw.items()})
        for name, value in values.items():
            aux_sums[name] = aux_sums.get(name, 0.0) + value / accum
        tokens += input_ids.numel()
    return MicroBatches(loss_sum / accum, aux_sums, tokens, input_ids.shape[1])


def sync_gradients(params: list[torch.nn.Parameter], world_size: int) -> None:
    """Average gradients over data-parallel ranks with one flat all-reduce. A parameter unused on one rank
    (an expert no local token chose) gets a zero gradient there, so every rank reduces the same list."""
    # on the parameters' device: NCCL reduces only GPU tensors
    used = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
    dist.all_reduce(used, op=dist.ReduceOp.MAX)
    live = [p for p, u in zip(params, used.tolist()) if u]
    for p in live:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in live]) / world_size
    dist.all_reduce(flat)
    offset = 0
    for p in live:
        p.grad.copy_(flat[offset: offset + p.numel()].view_as(p.grad))
        offset += p.numel()


def update_router_biases(job: Job) -> float:
    """Aux-loss-free MoE balancing after the optimiser step; returns the worst layer's max/mean expert load.
    Under data parallelism the loads are summed over ranks first, so every replica moves its biases alike."""
    if not job.rt.distributed:
        return job.model.update_router_biases()
    moes = job.model.moe_layers()
    counts = torch.stack([moe.load_counts() for moe in moes])  # [layers, 2, E]
    dist.all_reduce(counts)
    imbalance = max(moe.imbalance(c) for moe, c in zip(moes, counts))
    job.model.update_router_biases(counts=list(counts))
    return imbalance


def _reduce(job: Job, value: torch.Tensor | float, mean: bool) -> float:
    """Sum (or mean) of a per-rank number over all ranks; every rank must call it."""
    if not job.rt.distributed:
        return float(value)
    value = torch.tensor(float(value), dtype=torch.float64, device=job.rt.device)
    dist.all_reduce(value)
    return float(value / job.rt.world_size if mean else value)


def train_loop(job: Job) -> None:
    """Optimiser steps from the resumed step to trainer.max_steps; logs, checkpoints, stops on divergence."""
    cfg, state, rt = job.trainer, job.state, job.rt
    params = [p for group in job.optimizer.param_groups for p in group["params"]]
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    flops_cache: dict[int, float] = {}
    job.batches = iter(job.loader)
    job.model.train()
    progress = Progress(job.progress_bar and rt.rank == 0, state.step, cfg.max_steps)
    window_tokens, window_start = 0, time.perf_counter()
    try:
        while state.step < cfg.max_steps:
            step = state.step + 1
            lr = job.optimizer.param_groups[0]["lr"]
            micro = forward_backward(job)
            if rt.distributed:
                sync_gradients(params, rt.world_size)
            loss = _reduce(job, micro.loss, mean=True)
            # Stop before the update: the weights, and so every checkpoint, stay those of the last good step.
            if not math.isfinite(loss):
                raise TrainingDiverged(f"loss is {loss} at step {step}: stopped before its update, nothing saved")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            if not math.isfinite(grad_norm):
                raise TrainingDiverged(f"gradient norm is {grad_norm} at step {step}: stopped before its update")
            job.optimizer.step()
            job.scheduler.step()
            job.optimizer.zero_grad(set_to_none=True)
            imbalance = update_router_biases(job)
            state.step = step
            state.tokens_seen += micro.tokens * rt.world_size
            window_tokens += micro.tokens * rt.world_size
            tokens_per_s = window_tokens / max(time.perf_counter() - window_start, 1e-9)
            progress.update(loss, tokens_per_s)

            if step % job.log_every == 0 or step == cfg.max_steps:
                record = {
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens_per_s": tokens_per_s,
                    "tokens_seen": state.tokens_seen,
                    "mfu": _mfu(job, flops_cache, micro.seq_len, tokens_per_s),
                    "expert_imbalance": imbalance,
                    "memory_mb": memory_mb(rt.device),
                    "skipped_shards": int(_reduce(job, job.loader.skipped_shards, mean=False)),
                    **{name: _reduce(job, value, mean=True) for name, value in sorted(micro.aux.items())},
                }
                job.metrics.log(step, record)
                window_tokens, window_start = 0, time.perf_counter()

            if job.checkpointer.due(step, cfg.max_steps):
                path = job.checkpointer.save(step, job.ckpt_states)
                progress.write(f"checkpoint saved: {path}")
                window_tokens, window_start = 0, time.perf_counter()  # keep save time out of tokens/s
    finally:
        progress.close()


def _mfu(job: Job, cache: dict[int, float], seq_len: int, tokens_per_s: float) -> float:
    """Model FLOPs utilisation; without model.flops_per_token, falls back to 6 * parameters."""
    if seq_len not in cache:
        flops = getattr(job.model, "flops_per_token", None)
        cache[seq_len] = flops(seq_len) if flops else 6.0 * sum(p.numel() for p in job.model.parameters())
    return cache[seq_len] * tokens_per_s / (job.peak_flops * job.rt.world_size)


def fit(job: Job) -> None:
    try:
        train_loop(job)
    finally:
        job.metrics.close()
