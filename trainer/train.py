"""The pretraining loop and the set-up around it.

Contract: `build(cfg, run_dir)` turns the validated job config into a `Job` (runtime, model, optimiser, scheduler,
data, checkpointer, metrics), resuming from a checkpoint when `checkpoint.resume` finds one; `fit(job)` runs
`train_loop` and closes what `build` opened. Each builder receives only its own config section. Layout checks run
before any process group; the model is built on the meta device, parallelised (trainer/parallel/apply.py), then
materialised with the single process's initial values. `compute_gradients` runs one step's micro-batches and returns
its `StepStats`: every rank ends a step with the same loss and gradient norm; rank 0 logs.

Design and reasoning: docs/training.md#the-loop-and-its-set-up
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import random
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

import model as model_pkg
from data.multimodal import ROW_KINDS
from model.attention import head_rows
from model.config import ModelConfig
from optim import LRScheduler, build_optimizer
from trainer.batch import compute_device, local_chunk, to_device
from trainer.callbacks import Callbacks, load_callbacks, ordered
from trainer.canonical_vocab import install_canonical_vocab
from trainer.checkpoint import Checkpointer, RankLocalState, TrainState
from trainer.checkpoint.hf_io import is_hf_dir
from trainer.checkpoint.init_from import init_weights_from
from trainer.checkpoint.loading import find_checkpoint
from trainer.config import Config, ParallelConfig, ParallelDims, StageConfig, TrainerConfig
from trainer.loss import KindSums, LMLoss, StepTokens, valid_tokens
from trainer.metrics import MetricsLogger, device_peak_flops
from trainer.parallel.apply import ParallelModel, describe, materialize, parallelize, validate_layout
from trainer.parallel.compile import CUDAGRAPH_MODES, compile_blocks, is_compiled, mark_step
from trainer.parallel.expert import dropped_share
from trainer.parallel.gradients import clip_grad_norm_, mean_over_data, reduce_gradients, sum_over_data
from trainer.parallel.mesh import build_mesh
from trainer.preemption import StopRequest
from trainer.run_lock import RunLock
from trainer.stages.base import Stage, build_stage, check_starting_weights, indexer_or_all_parameters
from trainer.threads import ThreadChoice, contention_hint, set_cpu_threads

if TYPE_CHECKING:
    from trainer.parallel.mesh import Meshes

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """trainer.max_bad_steps consecutive steps had a non-finite loss or gradient norm; none of them was applied or
    saved."""


@dataclass
class Runtime:
    """Where this process runs: its rank, device, precision, the validated parallel sizes and their meshes."""

    rank: int
    world_size: int
    device: torch.device
    autocast_dtype: torch.dtype | None  # None: plain fp32
    dims: ParallelDims
    meshes: Meshes | None = None  # None for a single process
    threads: ThreadChoice | None = None  # CPU threads and what they were picked from (trainer/threads.py); None on GPU

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def setup_runtime(cfg: TrainerConfig, parallel: ParallelConfig, dims: ParallelDims | None = None) -> Runtime:
    """Device, precision, the process group (with a finite collective timeout: a dead or hung peer makes every
    other rank raise after parallel.timeout_s instead of waiting forever) and the device mesh."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dims = dims or parallel.resolve(world_size)
    kind, threads = cfg.device, None
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("trainer.device=cuda but no CUDA device is available")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        threads = set_cpu_threads(cfg.num_threads)  # 0: the cores this process may use / processes on the node
    if rank != 0:  # one voice per job: the other ranks log warnings and errors only
        logging.getLogger().setLevel(logging.WARNING)
    precision = cfg.precision if cfg.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    meshes = None
    if world_size > 1:
        if not dist.is_initialized():
            # On GPU, gloo beside NCCL: a few small bookkeeping collectives (MoE usage votes, metrics) run on CPU.
            backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=parallel.timeout_s))

        meshes = build_mesh(dims, device.type)
    return Runtime(rank, world_size, device, torch.bfloat16 if precision == "bf16" else None, dims, meshes, threads)


def apply_stage_hooks(model_cfg: ModelConfig, stage: StageConfig) -> ModelConfig:
    """The model config the stage trains (its hooks applied: SPEC 2's post-training switches), trainer/stages/base.py."""
    return build_stage(stage).model_config(model_cfg)


def build_model(cfg: ModelConfig, rt: Runtime, parallel: ParallelConfig, seed: int, *, batch_size: int,
                seq_len: int, grad_accum: int, compile_backend: str | None = None,
                compile_mode: str = "default", module_fn=None) -> ParallelModel:
    """This rank's part of the model, parallelised and holding the single process's initial values
    (trainer/parallel/apply.py); with pp > 1 also the pipeline schedule over grad_accum micro-batches.
    compile_backend: torch.compile every block with that backend (trainer.compile: "inductor"), after the plans and
    activation checkpointing, before FSDP (trainer/parallel/compile.py), in torch.compile's `compile_mode`.
    module_fn: what to build from `cfg` on the meta device instead of the Transformer (a stage's `build_module`:
    the DSpark drafter)."""
    cuts = validate_layout(parallel, cfg, seq_len=seq_len, grad_accum=grad_accum)
    with torch.device("meta"):
        model = (module_fn or model_pkg.build)(cfg)
    pm = parallelize(model, rt.meshes, parallel, rt.dims, cuts=cuts)
    if compile_backend is not None and compile_mode in CUDAGRAPH_MODES and (pm.fsdp or pm.dims.pp > 1
                                                                           or grad_accum > 1):
        # FSDP2 frees and re-allocates the gathered parameters around each block (a CUDA graph reads fixed
        # addresses); a pipeline schedule interleaves micro-batches' forwards and backwards; and a second
        # micro-batch's replay overwrites the graph outputs the first one's gradients were taken from (.grad)
        raise ValueError(f"trainer.compile_mode={compile_mode} (CUDA graphs) runs one micro-batch a step without FSDP "
                         f"and pipeline parallelism (parallel.dp_shard={parallel.dp_shard}, parallel.pp="
                         f"{parallel.pp}, trainer.grad_accum={grad_accum}): set trainer.compile_mode=default, or "
                         "grad_accum=1 and dp_replicate / tp / ep / cp only")
    if compile_backend is not None:
        compile_blocks(pm.module, compile_backend, mode=compile_mode)
    materialize(pm, rt.device, seed, microbatch_size=batch_size, seq_len=seq_len, grad_accum=grad_accum,
                schedule=parallel.pp_schedule, autocast_dtype=rt.autocast_dtype)
    return pm


def trainable_parameters(module: torch.nn.Module, cfg: ModelConfig) -> list[torch.nn.Parameter]:
    """What the pretraining optimiser owns of `module` (a Transformer or a pipeline StageGroup): every parameter,
    or only the indexers in the dense warm-up phase (trainer/stages/base.py)."""
    return indexer_or_all_parameters(module, cfg)


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
    pm: ParallelModel
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
    flops_per_token: object  # seq_len -> training FLOPs per token of the whole model (model/accounting.py)
    stage: Stage  # what is trained, on which batches, with which loss (trainer/stages/base.py)
    loss: LMLoss
    callbacks: Callbacks  # trainer/callbacks.py: the built-ins, the stage's, trainer.callbacks'
    batches: object = None  # the live iterator over `loader`
    stop: StopRequest | None = None  # installed by `fit`
    outcome: str = ""  # set by train_loop: "finished", "already_finished" or "stopped"
    last_checkpoint: Path | None = None
    last_checkpoint_step: int = -1

    @property
    def model(self) -> torch.nn.Module:
        """This rank's parameters under the whole model's names (the Transformer, or its pipeline stages)."""
        return self.pm.module

    def save_checkpoint(self, step: int, wait: bool = True) -> Path | None:
        """Save the run at `step` (every rank; a collective), then tell the callbacks. wait=False with
        checkpoint.async_save: the write goes on in the background and `poll_checkpoint` completes it (None here)."""
        self.poll_checkpoint(wait=True)  # at most one save in flight: the earlier one completes first
        self.last_checkpoint_step = step
        path = self.checkpointer.save(step, self.ckpt_states, extra={"skipped_steps": self.state.skipped_steps},
                                      wait=wait)
        if path is not None:
            self._saved(step, path)
        return path

    def poll_checkpoint(self, wait: bool = False) -> None:
        """Complete the asynchronous save in flight once every rank's write is done (wait: block until then)."""
        step = self.checkpointer.pending_step
        path = self.checkpointer.finish() if wait else self.checkpointer.poll()
        if path is not None:
            self._saved(step, path)

    def _saved(self, step: int, path: Path) -> None:
        self.last_checkpoint = path
        self.callbacks.on_checkpoint(self, step, path)


def hyperparameter_changes(marker: dict, loaded_groups: list[dict], cfg: Config) -> list[tuple[str, object, object]]:
    """(key, checkpoint's value, config's value) for each optimiser hyperparameter (the optim section and
    trainer.max_steps) a resume changes. The marker records them; a checkpoint from before that is compared on what
    its param groups held (lr, betas, eps, weight decay)."""
    current = {f"optim.{k}": v for k, v in dataclasses.asdict(cfg.optim).items()}
    current["trainer.max_steps"] = cfg.trainer.max_steps
    if "optim" in marker:
        saved = {f"optim.{k}": v for k, v in marker["optim"].items()}
        saved["trainer.max_steps"] = marker.get("max_steps")
    elif loaded_groups:
        first = loaded_groups[0]
        saved = {"optim.lr": first.get("initial_lr", first.get("lr")), "optim.eps": first.get("eps"),
                 "optim.betas": list(first.get("betas", ())), "optim.weight_decay": first.get("weight_decay")}
    else:
        return []
    norm = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731 (JSON keeps tuples as lists)
    return [(k, saved[k], current[k]) for k in sorted(saved)
            if k in current and saved[k] is not None and norm(saved[k]) != norm(current[k])]


def check_fused_loss(cfg: Config, loss: LMLoss) -> None:
    """trainer.fused_loss=true's rules (trainer/fused_loss.py), before any process group: a loss computed from the
    logits alone (`supports_fused`), the whole head on the rank that computes the loss (no vocab-sharded head, no
    pipeline). Raises ValueError naming the key."""
    if not cfg.trainer.fused_loss:
        return
    if not loss.supports_fused:
        raise ValueError(f"trainer.fused_loss=true computes the plain LM loss from the head's input, but "
                         f"stage.name={cfg.stage.name}'s loss ({type(loss).__name__}) reads the logits themselves: "
                         "set trainer.fused_loss=false")
    par = cfg.parallel
    if par.pp > 1 or par.tp > 1:
        raise ValueError("trainer.fused_loss=true needs the whole output head where the loss is computed: not under "
                         "tensor parallelism (its vocab-sharded head and loss_parallel) or pipeline parallelism (the "
                         f"last stage's loss reads whole logits); got parallel.tp={par.tp}, parallel.pp={par.pp}: "
                         "set trainer.fused_loss=false or tp = pp = 1")


def check_multimodal(cfg: Config, model_cfg) -> None:
    """data=multimodal's rules (data/multimodal.py's batches into the backbone's image path), before any process
    group: a model with a vision tower and the same placeholder id, the pretraining stage, and a layout the image
    path runs under. Raises ValueError naming the key."""
    if not hasattr(cfg.data, "multimodal"):
        return
    mm = cfg.data.multimodal
    if cfg.stage.name != "pretrain":
        raise ValueError(f"data=multimodal feeds stage=pretrain; stage.name={cfg.stage.name} reads its own data "
                         "(data.sft / the environments / the teacher's prompts) as text: use data=default")
    if mm.text_to_multimodal == 0:
        return  # text only: no image reaches the model
    if model_cfg.vision.num_layers == 0:
        raise ValueError(f"data=multimodal mixes in image-text rows, but model={model_cfg.name} has no vision tower "
                         "(model.vision.num_layers=0): use model=v41_tiny_mm (or a model with a vision section), "
                         "or data.multimodal.text_to_multimodal=0 for text only")
    if mm.image_token_id != model_cfg.image_token_id:
        raise ValueError(f"data.multimodal.image_token_id={mm.image_token_id} differs from model.image_token_id="
                         f"{model_cfg.image_token_id}: the loader's placeholders must be the ids the model replaces "
                         "with the tower's features; set both to the same id")
    if not 0 <= mm.image_token_id < model_cfg.vocab_size:
        raise ValueError(f"model.image_token_id={mm.image_token_id} is outside model.vocab_size="
                         f"{model_cfg.vocab_size}")
    par = cfg.parallel
    if par.pp > 1:
        raise ValueError(f"data=multimodal with parallel.pp={par.pp}: pipeline parallelism does not carry images (the "
                         "tower would run on the first stage, but the pipeline's wire has no pixel values or image "
                         "grids, and the placeholders' features must be in place before layer 0): set parallel.pp=1 "
                         "or data.multimodal.text_to_multimodal=0")
    if par.cp > 1:
        raise ValueError(f"data=multimodal with parallel.cp={par.cp}: an image's placeholder run may cross a context-"
                         "parallel chunk, which the image path does not split: set parallel.cp=1")
    if cfg.stage.bounded_replay_sim:
        raise ValueError("data=multimodal with stage.bounded_replay_sim=true: the bounded-replay simulation runs on "
                         "text only: set stage.bounded_replay_sim=false")


def build(cfg: Config, run_dir: Path) -> Job:
    stage = build_stage(cfg.stage)
    loss = stage.loss()
    check_fused_loss(cfg, loss)  # as early as the layout rules: a bad combination fails before any process group
    loss.fused = cfg.trainer.fused_loss
    model_cfg = stage.model_config(cfg.model)
    check_multimodal(cfg, model_cfg)
    user_callbacks = load_callbacks(cfg.trainer.callbacks)  # a bad import path fails before any process group
    stage.check_layout(cfg.parallel)  # a stage's own rules (RL's rollouts need the whole model), as early
    stage.check(cfg)  # and on the rest of the job (dspark needs its backbone)
    check_starting_weights(cfg)  # sft, rl, distill: not from random weights unless asked
    # Every layout rule before any process group exists (the model's first, then the world size): a bad layout
    # fails at once, on every rank alike, naming the key to change.
    validate_layout(cfg.parallel, model_cfg, seq_len=cfg.data.seq_len, grad_accum=cfg.trainer.grad_accum)
    dims = cfg.parallel.resolve(int(os.environ.get("WORLD_SIZE", "1")))
    rt = setup_runtime(cfg.trainer, cfg.parallel, dims)
    RunLock.acquire(run_dir, rt.rank)  # held since Hydra's callback when launched through trainer.cli.main
    data_rank = rt.meshes.data.get_local_rank() if rt.meshes is not None else 0
    loader, tokenizer = stage.batches(cfg, data_rank, dims.data, progress=rt.rank == 0)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ValueError(
            f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's {tokenizer.vocab_size} ids "
            f"({tokenizer.path})"
        )
    info = {"model": dataclasses.asdict(model_cfg), "layout": dataclasses.asdict(dims),
            "optim": dataclasses.asdict(cfg.optim), "max_steps": cfg.trainer.max_steps, "stage": cfg.stage.name}
    if cfg.checkpoint.init_from:  # which weights the run started from, in every checkpoint's marker

        try:
            init = Path(cfg.checkpoint.init_from)
            info["init_from"] = str((init if is_hf_dir(init) else find_checkpoint(cfg.checkpoint.init_from)).resolve())
        except ValueError as e:
            raise ValueError(f"checkpoint.init_from: {e}".replace("ckpt=", "")) from None
        if stage.reads_init_from:  # the stage's frozen model (dspark's backbone), not these weights
            info["backbone"] = info["init_from"]
    checkpointer = Checkpointer(run_dir / "checkpoints", cfg.checkpoint, rt.rank, info=info)
    resume_from = checkpointer.resume_path()
    if resume_from is not None:  # before the model is built: an incompatible checkpoint fails at once
        checkpointer.check_model(resume_from, model_cfg)
    pm = build_model(model_cfg, rt, cfg.parallel, cfg.trainer.seed, batch_size=cfg.data.batch_size,
                     seq_len=cfg.data.seq_len, grad_accum=cfg.trainer.grad_accum,
                     compile_backend=cfg.trainer.compile_backend if cfg.trainer.compile else None,
                     compile_mode=cfg.trainer.compile_mode, module_fn=stage.build_module)
    log.info("parallel layout: %s%s", describe(pm), f"; CPU {rt.threads.describe()}" if rt.threads else "")
    if cfg.trainer.compile:  # torch.compile works silently in the first step: say so before it starts
        log.info("trainer.compile: %d blocks are compiled by torch.compile (%s) during the first step, and again for "
                 "a new input shape (an evaluation's): minutes on a CPU, where compiling rarely pays (README, 'Step "
                 "efficiency'); the ETA leaves the first step out", sum(map(is_compiled, pm.module.modules())),
                 cfg.trainer.compile_backend)
    if rt.threads and (hint := contention_hint(rt.threads, "trainer.num_threads")):
        log.warning(hint)
    install_canonical_vocab(pm.module, model_cfg, tokenizer.path)
    trainable = stage.trainable_parameters(pm.module, model_cfg)
    freeze_all_but(pm.module, trainable)
    optimizer = build_optimizer(trainable, cfg.optim, named=pm.module.named_parameters(),
                                head_rows=head_rows(model_cfg), log=log.info)
    scheduler = LRScheduler(optimizer, cfg.optim, total_steps=cfg.trainer.max_steps)
    state = TrainState(pm.module, optimizer, scheduler)
    ckpt_states = {"train": state, "rank_local": RankLocalState(loader, rt.rank, data_rank)}
    seed_everything(cfg.trainer.seed + rt.rank)  # anything random after init differs per rank
    if resume_from is None and cfg.checkpoint.init_from and not stage.reads_init_from:
        init_weights_from(cfg.checkpoint.init_from, pm, optimizer if cfg.checkpoint.init_optimizer else None,
                          model_cfg, checkpointer)
    if resume_from is not None:
        checkpointer.load(resume_from, ckpt_states)
    # A relaunch with nothing left to do (the resumed step is trainer.max_steps) starts no W&B run: W&B would write a
    # new offline run directory for it.
    wandb_cfg = cfg.logger.wandb if state.step < cfg.trainer.max_steps else dataclasses.replace(cfg.logger.wandb,
                                                                                                mode="disabled")
    metrics = MetricsLogger(run_dir, wandb_cfg, rt.rank, config=dataclasses.asdict(cfg))
    if resume_from is not None:
        marker = checkpointer.marker(resume_from)
        state.skipped_steps = int(marker.get("skipped_steps", 0))
        metrics.truncate_after(state.step)
        log.info("resumed from %s at step %d", resume_from, state.step)
        for key, old, new in hyperparameter_changes(marker, state.loaded_hyperparameters, cfg):
            log.info("resume: %s changed from %r (checkpoint) to %r (config); the config's value is used", key, old,
                     new)
    flops_per_token = stage.flops_per_token(model_cfg)  # dspark: a backbone forward and the drafter's training
    job = Job(
        rt=rt, trainer=cfg.trainer, pm=pm, optimizer=optimizer, scheduler=scheduler, state=state,
        loader=loader, checkpointer=checkpointer, ckpt_states=ckpt_states, metrics=metrics,
        log_every=cfg.logger.log_every, progress_bar=cfg.logger.progress_bar,
        peak_flops=device_peak_flops(rt.device, cfg.trainer.peak_flops), run_dir=run_dir,
        flops_per_token=flops_per_token, stage=stage, loss=loss,
        callbacks=ordered([*stage.callbacks(), *user_callbacks]),
    )
    stage.bind(job)  # a stage whose batches need the model (RL's rollouts, a teacher's scores)
    return job


_BATCH_KEYS = ("input_ids", "labels", "image_mask", "loss_weights", "replay_cuts", "routing", "pixel_values", "grids")


def _loss_inputs(batch: dict, device: torch.device) -> dict:
    """A batch's tensors besides the model's inputs and labels (a stage's loss inputs, e.g. RL advantages), on
    `device`."""
    return {k: v.to(device) for k, v in batch.items() if k not in _BATCH_KEYS and isinstance(v, torch.Tensor)}


def _model_extras(batch: dict, device: torch.device) -> dict:
    """The forward's optional inputs a stage's batches carry: `replay_cuts` (the bounded-replay simulation hook,
    model/replay.py), `routing` (a rollout's recorded choices to replay, model/routing.py) and the images of a
    multimodal batch (data/multimodal.py: `pixel_values` [S, 588] and `grids` [N, 2], packed; none when N = 0)."""
    extras = {}
    grids = batch.get("grids")
    if grids is not None and grids.shape[0] > 0:  # the grids stay host ints (the tower's shapes)
        extras["images"] = (batch["pixel_values"].to(device, non_blocking=True), [tuple(g) for g in grids.tolist()])
    if batch.get("replay_cuts") is not None:
        extras["replay_cuts"] = batch["replay_cuts"].to(device)
    if batch.get("routing") is not None:
        extras["routing"] = batch["routing"].to(device)
    return extras


@dataclass
class MicroBatches:
    """What one optimiser step's micro-batches produced on this rank."""

    loss: float  # this rank's part of the step's LM loss (trainer/loss.py): the global token mean after mean_over_data
    aux: dict[str, float]  # means of "aux/<name>" (weighted terms added to the loss), "aux_metric/<name>" (raw)
    tokens: int  # input tokens this data rank read (whole sequences, before any context-parallel split)
    seq_len: int
    kinds: KindSums | None = None  # per row kind, this rank's loss sums and valid tokens (multimodal batches)


def step_tokens(pm: ParallelModel, batches: list[dict]) -> StepTokens:
    """The step's loss normalisation (trainer/loss.py): valid labels of the global batch (summed over the ranks that
    read different data: one all-reduce), the ranks the gradient mean runs over (dp x ep x cp), the micro-batches."""
    (total,) = sum_over_data(pm, [sum(valid_tokens(b["labels"]) for b in batches)])
    return StepTokens(int(round(total)), pm.dims.data * pm.dims.cp, len(batches))


def forward_backward(pm: ParallelModel, batches: list[dict], autocast_dtype: torch.dtype | None,
                     loss: LMLoss | None = None) -> MicroBatches:
    """Forward and backward over this data rank's micro-batches (loader batches of whole sequences), one after the
    other or through the pipeline schedule; the gradient of the step's loss (`loss`, set for this step by
    `LMLoss.begin_step`; default: this rank's tokens alone) accumulates in .grad. A fused loss (`loss.fused`,
    trainer.fused_loss) gets the head's input and the head instead of logits (trainer/fused_loss.py)."""
    if loss is None:
        loss = LMLoss()
        loss.begin_step(StepTokens(sum(valid_tokens(b["labels"]) for b in batches), 1, len(batches)))
    fused = loss.fused
    if fused and (pm.pipeline is not None or pm.loss_parallel):
        raise ValueError("trainer.fused_loss=true does not run under pipeline parallelism or loss_parallel "
                         "(tensor parallelism): set trainer.fused_loss=false")
    if pm.pipeline is not None:
        return _pipeline_forward_backward(pm, batches, loss)
    accum, device = len(batches), compute_device(pm)
    if pm.loss_parallel:  # the logits are vocab-sharded DTensors: cross-entropy and backward under loss_parallel
        from torch.distributed.tensor.parallel import loss_parallel as loss_context
    else:
        loss_context = contextlib.nullcontext
    loss_sum, aux_sums, tokens = 0.0, {}, 0
    for batch in batches:
        input_ids, labels, image_mask, weights = to_device(batch, device)
        tokens += input_ids.numel()
        seq_len = input_ids.shape[1]
        input_ids, labels, image_mask, weights = local_chunk(pm, input_ids, labels, image_mask, weights)
        mark_step(pm.module)
        if pm.engram is not None:
            # Row ids depend only on token ids: the rows' exchange goes out before the forward and travels while
            # the layers in front of each Engram layer compute. Not issued earlier (during the previous micro-
            # batch's backward): a recomputed Engram forward (activation checkpointing) would consume it.
            pm.engram.prefetch(input_ids, image_mask)
        with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            out = pm.module(input_ids, image_mask=image_mask, outputs=True, **_model_extras(batch, device),
                            **({"logits": False} if fused else {}))
            if fused:  # the head's matmul inside the loss, under the forward's autocast as the plain head runs;
                # under FSDP2 the root (holding the head) stays gathered after its forward: head.weight is whole
                term = loss(None, labels, weights, aux=sum(out.aux.values()), batch=_loss_inputs(batch, device),
                            hidden=out.hidden, head=pm.module.head)
        with loss_context():
            if not fused:
                term = loss(out.logits, labels, weights, aux=sum(out.aux.values()), batch=_loss_inputs(batch, device))
            # each micro-batch's loss is divided by accum: the accumulated gradient is the mean over micro-batches
            # of terms already weighted by their share of the step's valid tokens (trainer/loss.py)
            (term / accum).backward()
        loss_sum += float(loss.lm_terms[-1])
        values = {f"aux/{k}": float(v.detach()) for k, v in out.aux.items()}
        values.update({f"aux_metric/{k}": v for k, v in out.metrics.items()})
        if pm.dims.ep > 1:  # the sync-free dispatcher (parallel.ep_capacity_factor > 0) counts what it drops

            share = dropped_share(pm.module, input_ids.numel())  # this micro-batch's (a recompute writes the same)
            if share is not None:  # the mean over micro-batches and data ranks: the step's share of copies dropped
                values["aux_metric/moe_dropped_share"] = share
        for name, value in values.items():
            aux_sums[name] = aux_sums.get(name, 0.0) + value / accum
    return MicroBatches(loss_sum / accum, aux_sums, tokens, seq_len, loss.kind_sums)


def _pipeline_forward_backward(pm: ParallelModel, batches: list[dict], loss: LMLoss) -> MicroBatches:
    """The micro-batches as one [M*B, T] batch through the schedule; the last stage's loss terms reach every
    pipeline rank (Pipeline.step). Row-sharded Engram lookups go unprefetched here: the schedule runs the
    micro-batches' forwards itself, and stages past the first receive their row ids across the cut."""
    device = compute_device(pm)
    parts = [to_device(batch, device) for batch in batches]
    if any(p[2] is not None for p in parts):
        raise ValueError("pipeline parallelism: these batches carry images (an image mask), which the pipeline's "
                         "schedule does not take; data=multimodal runs with parallel.pp=1")
    input_ids, labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    weights = None
    if any(p[3] is not None for p in parts):
        weights = torch.cat([p[3] if p[3] is not None else torch.ones_like(p[1], dtype=torch.float32)
                             for p in parts])
    tokens, seq_len = input_ids.numel(), input_ids.shape[1]
    input_ids, labels, weights = local_chunk(pm, input_ids, labels, weights)
    pm.pipeline.loss.lm = loss  # the stage's loss computes the last stage's LM term
    pm.pipeline.step(input_ids, labels, weights=weights, tokens=loss.tokens)
    terms, cfg, aux = pm.pipeline.metrics, pm.cfg, {}
    if cfg.csa2.index_source_layers:  # the same keys the whole model's aux dict has
        aux["aux/indexer_kl"] = cfg.indexer.loss_coef * terms["indexer_kl"]
        aux["aux_metric/indexer_kl"] = terms["indexer_kl"]
    if cfg.moe.seq_aux_loss_coef > 0:
        aux["aux/moe_seq_balance"] = aux["aux_metric/moe_seq_balance"] = terms["moe_seq_balance"]
    return MicroBatches(terms["lm"], aux, tokens, seq_len)


@dataclass
class StepStats:
    """One optimiser step's numbers, the same on every rank."""

    loss: float  # LM loss, the mean over every valid token of the global batch (trainer/loss.py)
    grad_norm: float  # before clipping; nan when the loss was not finite (the norm is then not computed)
    aux: dict[str, float] = field(default_factory=dict)
    tokens: int = 0  # tokens of the global batch
    seq_len: int = 0
    lr: float = math.nan  # the lr the step applied with (set by the loop)
    extra: dict[str, float] = field(default_factory=dict)  # callbacks' numbers for this step's metrics record

    @property
    def finite(self) -> bool:
        """False: the step must not be applied (trainer.max_bad_steps)."""
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


def compute_gradients(pm: ParallelModel, batches: list[dict], params: list[torch.nn.Parameter], max_norm: float,
                      autocast_dtype: torch.dtype | None = None, step: int = 0, loss: LMLoss | None = None,
                      forward=None, optimizer=None) -> StepStats:
    """Forward, backward, gradient reduction and clipping of one optimiser step; leaves the clipped gradients in
    .grad. loss: the stage's (default `LMLoss`), normalised over the step's global valid tokens (`step_tokens`).
    forward: a stage's own `forward_backward` (same signature and result; dspark's runs the frozen backbone, then
    the drafter), else the model's. optimizer: the one the caller steps next; where it takes the clip into its step
    (`clip_in_step`, optim.clip_in_step) the gradients are left unclipped for it to scale.
    A non-finite loss or norm (`StepStats.finite` false, the same on every rank: both are job-wide reductions)
    leaves gradients the caller must drop instead of applying."""
    loss = loss or LMLoss()
    loss.begin_step(step_tokens(pm, batches))
    micro = (forward or forward_backward)(pm, batches, autocast_dtype, loss)
    reduce_gradients(pm)
    names = sorted(micro.aux)
    loss, *aux = mean_over_data(pm, [micro.loss, *(micro.aux[n] for n in names)])
    # A non-finite loss skips the norm's collectives on every rank alike (the loss is the job-wide mean).
    fold = optimizer if getattr(optimizer, "clip_in_step", False) else None
    grad_norm = float(clip_grad_norm_(params, max_norm, pm, fold)) if math.isfinite(loss) else math.nan
    stats = StepStats(loss, grad_norm, dict(zip(names, aux)), micro.tokens * pm.dims.data, micro.seq_len)
    if micro.kinds is not None:
        stats.extra.update(kind_losses(pm, micro.kinds))
    return stats


def kind_losses(pm: ParallelModel, kinds: KindSums) -> dict[str, float]:
    """{"loss_<kind>": the global token mean of that kind's rows} (data/multimodal.py ROW_KINDS: loss_text,
    loss_multimodal) from this rank's sums (one all-reduce over the data ranks); a kind with no valid token in the
    step's global batch has no entry."""
    k = len(ROW_KINDS)  # = LMLoss.num_kinds, the length of the sums
    values = sum_over_data(pm, [*kinds.loss.tolist(), *kinds.tokens.tolist()])
    return {f"loss_{name}": values[i] / values[k + i] for i, name in enumerate(ROW_KINDS) if values[k + i] > 0}


def train_loop(job: Job) -> None:
    """Optimiser steps from the resumed step to trainer.max_steps, the same loop for every stage: gradients, the
    update (or its skip: a non-finite step is not applied, and the run stops after trainer.max_bad_steps in a row),
    the step count; the callbacks do the rest (trainer/callbacks.py: balancing, metrics, checkpoints). A stop
    signal (`job.stop`) ends the run after the step in flight, with a checkpoint. Sets `job.outcome`."""
    cfg, state, rt, callbacks = job.trainer, job.state, job.rt, job.callbacks
    if state.step >= cfg.max_steps:
        job.outcome = "already_finished"
        return
    params = [p for group in job.optimizer.param_groups for p in group["params"]]
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    job.batches = iter(job.loader)
    job.model.train()
    bad_streak: list[tuple[int, StepStats]] = []
    callbacks.on_train_start(job)
    try:
        while state.step < cfg.max_steps:
            step = state.step + 1
            lr = job.optimizer.param_groups[0]["lr"]
            callbacks.on_step_start(job, step)
            batches = [next(job.batches) for _ in range(cfg.grad_accum)]
            stats = compute_gradients(job.pm, batches, params, max_norm, rt.autocast_dtype, step, job.loss,
                                      forward=job.stage.forward_backward, optimizer=job.optimizer)
            stats.lr = lr
            if stats.finite:
                callbacks.on_before_optimizer_step(job, step, stats)
                job.optimizer.step()
                bad_streak.clear()
            else:  # no update: the weights, and so every checkpoint, stay those of the last good step
                bad_streak.append((step, stats))
                state.skipped_steps += 1
                if len(bad_streak) >= cfg.max_bad_steps:
                    raise TrainingDiverged(_diverged_message(bad_streak, cfg.max_bad_steps, job.last_checkpoint))
                log.warning("step %d skipped: loss %s, gradient norm %s (%d of trainer.max_bad_steps=%d in a row)",
                            step, stats.loss, stats.grad_norm, len(bad_streak), cfg.max_bad_steps)
            job.scheduler.step()  # the lr follows the step count, applied or not
            job.optimizer.zero_grad(set_to_none=True)
            callbacks.on_after_optimizer_step(job, step, stats)
            state.step = step
            state.tokens_seen += stats.tokens
            callbacks.on_step_end(job, step, stats)
            job.poll_checkpoint()
            if job.stop is not None and job.stop.agreed(rt.distributed):
                if job.last_checkpoint_step != step:
                    job.save_checkpoint(step)
                job.poll_checkpoint(wait=True)
                job.outcome = "stopped"
                return
        job.poll_checkpoint(wait=True)
        job.outcome = "finished"
    finally:
        callbacks.on_train_end(job)


def _diverged_message(streak: list[tuple[int, StepStats]], limit: int, last_checkpoint: Path | None) -> str:
    first_step, first = streak[0]
    what = f"loss is {first.loss}" if not math.isfinite(first.loss) else f"gradient norm is {first.grad_norm}"
    steps = f"step {first_step}" if len(streak) == 1 else f"steps {first_step}-{streak[-1][0]}"
    where = f"; the newest checkpoint of this launch is {last_checkpoint}" if last_checkpoint else ""
    return (f"{what} at step {first_step}: {len(streak)} non-finite step(s) in a row ({steps}, "
            f"trainer.max_bad_steps={limit}), none of them applied or saved{where}")


def fit(job: Job, stop: StopRequest | None = None) -> str:
    """Train until trainer.max_steps or a stop signal; returns `job.outcome`. `stop`: a request installed before the
    set-up (an entry point's, so that a signal during `build` is honoured too); without it the stop signals are handled
    only while this runs. Either way they are uninstalled when it returns."""
    job.stop = stop or StopRequest(job.trainer.stop_deadline_s).install()
    try:
        train_loop(job)
    finally:
        job.stop.uninstall()
        job.metrics.close()
    return job.outcome
