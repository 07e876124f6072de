"""Typed job configuration: the schema Hydra validates `conf/config.yaml` and every config group against.

The root `Config` has one section per component; each component is handed only its own section, as a
dataclass instance made by `OmegaConf.to_object` so every `__post_init__` check has run. Struct mode
makes a misspelled key or a value of the wrong type fail at composition, naming the full key path.

OmegaConf 2.3 has no Literal support: closed sets are `choice_field`s (config_checks.py) checked in `__post_init__`,
which raise ValueError naming the key and the bad value.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, List, Optional

from config_checks import at_least, check_choices, choice_field, positive
from data.config import DataConfig
from data.multimodal import MultimodalDataConfig
from model.config import ModelConfig
from optim.config import OptimConfig
from trainer.stages.config import STAGE_SCHEMAS, StageConfig


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")


@dataclass
class TrainerConfig:
    max_steps: int = 300
    """optimiser steps of the whole run (a resumed run stops at the same step)"""
    grad_accum: int = 1
    """micro-batches per optimiser step on each data rank, accumulated or run through the pipeline schedule
    (Megatron's number of micro-batches); each holds data.batch_size rows"""
    grad_clip: float = 1.0
    """max global gradient L2 norm; 0 turns clipping off (the norm is still logged)"""
    seed: int = 0
    """weights are initialised from `seed` on every rank (each piece of the model from its own seed derived from
    it, so every layout starts from the same values); per-rank randomness from seed + rank"""
    device: str = choice_field("auto", ("auto", "cpu", "cuda"))
    """auto: cuda when available, else cpu"""
    precision: str = choice_field("auto", ("auto", "bf16", "fp32"))
    """auto: bf16 autocast on GPU, fp32 on CPU. Parameters and optimiser state stay fp32 either way"""
    num_threads: int = 0
    """CPU threads per process; 0 = the cores this process may use (affinity mask, cgroup CPU quota) divided by the
    processes on this node (LOCAL_WORLD_SIZE): trainer/threads.py"""
    peak_flops: float = 0.0
    """peak FLOP/s of one device for MFU; 0 = a table for known GPUs, else measured by a matmul at start"""
    max_bad_steps: int = 3
    """a step whose loss or gradient norm is not finite (NaN / Inf) is skipped: no update, no bias move, counted as
    `skipped_steps` in the metrics; the run stops after this many consecutive bad steps, the last good checkpoint
    intact (1 = stop at the first one)"""
    stop_deadline_s: float = 120.0
    """after SIGTERM / SIGUSR1 (preemption, a time limit) the run finishes its step, saves and exits 0; if that has
    not happened this many seconds after the signal, it exits with status 143 (0 = no deadline). Keep it below the
    launcher's grace period (Slurm's --signal lead time, torchrun's 30 s after it is itself signalled)"""
    compile: bool = False
    """torch.compile each block on its own (regional compilation, as torchtitan does: a graph per block, fullgraph,
    no graph breaks), after activation checkpointing and before FSDP; the embedding, the loop over blocks, the head
    and the loss stay eager (trainer/parallel/compile.py)"""
    compile_backend: str = "inductor"
    """torch.compile's backend with trainer.compile=true: inductor (fused kernels); aot_eager traces forward and
    backward without generating code (to tell a compiler bug from a model bug), eager runs only Dynamo's capture"""
    compile_mode: str = choice_field("default", COMPILE_MODES)
    """torch.compile's mode with trainer.compile=true and the inductor backend. reduce-overhead records each block's
    forward and backward graphs as CUDA graphs (cudagraph trees): one replay instead of a launch per kernel, for a
    step whose device idles between launches (BENCHMARKS.md, issue 16); it costs a memory pool for the graphs'
    activations and is not used on a CPU. max-autotune(-no-cudagraphs) also tunes the GEMMs and kernels (long
    compiles)"""
    fused_loss: bool = False
    """output head + cross-entropy fused and chunked over tokens (trainer/fused_loss.py): the [B, T, V] fp32 logits
    of a training forward never exist; the plain-LM losses only (pretraining, SFT), not under loss_parallel or pp"""
    callbacks: List[str] = field(default_factory=list)
    """extra trainer/callbacks.py callbacks, by import path ("package.module:Class"), run after the router-bias
    update and the stage's, before the metrics record and the checkpoint, e.g. trainer.callbacks='[mypkg.hooks:Probe]'"""

    def __post_init__(self) -> None:
        at_least("trainer.max_steps", self.max_steps, 1)
        at_least("trainer.max_bad_steps", self.max_bad_steps, 1)
        at_least("trainer.stop_deadline_s", self.stop_deadline_s, 0.0)
        at_least("trainer.grad_accum", self.grad_accum, 1)
        at_least("trainer.grad_clip", self.grad_clip, 0.0)
        at_least("trainer.num_threads", self.num_threads, 0)
        at_least("trainer.peak_flops", self.peak_flops, 0.0)
        check_choices(self, "trainer")
        if self.compile_mode != "default" and self.compile_backend != "inductor":
            raise ValueError(f"trainer.compile_mode={self.compile_mode} is a mode of the inductor backend, got "
                             f"trainer.compile_backend={self.compile_backend}: set trainer.compile_mode=default")


ENGRAM_SHARD_AXES = ("dp_replicate", "dp_shard", "ep", "cp")  # the axes of Meshes.dp_ep_cp, in mesh order
PP_SCHEDULES = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
ACTIVATION_CHECKPOINT_MODES = ("none", "full")


@dataclass
class ParallelConfig:
    """How the job's processes split the work. The sizes multiply to the world size:
    dp_replicate * dp_shard * tp * pp * ep * cp.

    Megatron-LM equivalents are named under each field. Micro-batches: `data.batch_size` rows per micro-batch
    (Megatron's --micro-batch-size) and `trainer.grad_accum` micro-batches per optimiser step on each data rank
    (Megatron's number of micro-batches, global batch / (micro-batch x data-parallel size)); the pipeline runs
    the same grad_accum micro-batches through its schedule, so one global batch means the same thing in every
    layout: dp_replicate * dp_shard * ep * grad_accum * batch_size rows.

    Ranks that read different data: dp_replicate x dp_shard x ep (expert-parallel ranks route their own tokens,
    as in Megatron, where the expert-parallel group lies inside the data-parallel group). Checks that need the
    model (divisibility of heads, experts, layers, sequence) run at start-up in trainer.parallel.apply.
    """

    dp_replicate: int = 1
    """full model replicas, gradients all-reduced (DDP; Megatron --data-parallel-size without the distributed
    optimiser); -1 = world size / the product of the others"""
    dp_shard: int = 1
    """FSDP2 shards: parameters, gradients and optimiser state split over these ranks, gradients reduce-scattered
    in fp32 (Megatron --use-distributed-optimizer with --data-parallel-sharding-strategy optim_grads_params, i.e.
    ZeRO-3 / Megatron-FSDP); with dp_replicate > 1 as well it is HSDP"""
    tp: int = 1
    """tensor parallel size: attention heads, expert width, embedding channels and vocabulary split
    (Megatron --tensor-model-parallel-size)"""
    sequence_parallel: bool = False
    """with tp > 1, keep activations between sub-blocks split along the sequence (Megatron --sequence-parallel);
    with pp > 1 the streams, `pre` and h_mid cross stage cuts as each tp rank's sequence shard"""
    pp: int = 1
    """pipeline ranks (Megatron --pipeline-model-parallel-size)"""
    pp_virtual: int = 1
    """stages per pipeline rank: pp * pp_virtual stages in all (Megatron --virtual-pipeline-model-parallel-size);
    1F1B needs 1, ZBVZeroBubble needs 2"""
    pp_schedule: str = choice_field("1F1B", PP_SCHEDULES)
    """torch.distributed.pipelining schedule: 1F1B (Megatron's default), Interleaved1F1B (Megatron's schedule
    when virtual stages are set), InterleavedZeroBubble or ZBVZeroBubble (zero-bubble schedules, no Megatron-LM
    core equivalent)"""
    pp_cuts: list[int] = field(default_factory=list)
    """first layer of every stage but the first (pp * pp_virtual - 1 increasing layer indices); [] = the
    balanced split of trainer.parallel.pipeline.split_points (Megatron --decoder-first/last-pipeline-num-layers
    set uneven stages)"""
    ep: int = 1
    """expert parallel size: each rank holds num_experts / ep routed experts of every MoE layer and reads its own
    data (Megatron --expert-model-parallel-size)"""
    cp: int = 1
    """context parallel size: every sequence split into cp contiguous chunks (Megatron --context-parallel-size)"""
    ep_capacity_factor: float = 0.0
    """with ep > 1, how the expert-parallel all-to-all sizes its messages (trainer/parallel/expert.py). 0 = dropless:
    variable split sizes read on the host (one sync per MoE layer; exact). > 0 = sync-free: each rank sends a fixed
    C = ceil(factor * S / ep) rows to every ep rank (S = tokens x experts_per_token copies the rank routes), padded,
    so a step has static shapes (torch.compile fullgraph, CUDA graphs); copies beyond a destination rank's C are
    dropped (their expert output counts as zero: the token keeps its other copies and the shared expert), counted
    per layer in the dispatcher's `dropped` and logged each step as `aux_metric/moe_dropped_share` (the share of the
    routed copies dropped; not under pp). factor >= ep gives C = S: never drops, exact and sync-free, at ep times
    the dropless message size. Needs the same number of tokens on every ep rank. Megatron --moe-expert-capacity-factor
    with --moe-pad-expert-input-to-capacity, except that the capacity is per destination rank, not per expert"""
    engram_shard: bool = False
    """split every Engram table by rows over the ranks of one pipeline stage and tp rank (dp_replicate x dp_shard x ep
    x cp: Meshes.dp_ep_cp), lookups and row gradients travelling by all-to-all (trainer/parallel/engram.py); false
    keeps whole tables on every rank, replicated like any dense weight. The flagship needs it (a 98B-row table holds
    1.6 TB of AdamW state). No effect in a single process. No Megatron-LM equivalent"""
    engram_shard_over: list[str] = field(default_factory=lambda: list(ENGRAM_SHARD_AXES))
    """with engram_shard: the axes whose ranks split the rows (a non-empty subset of dp_replicate, dp_shard, ep, cp);
    the ranks of the other ones among these four hold the same rows and all-reduce their row gradients. Default: all
    four, so each of a stage's dp x ep x cp ranks holds 1 / (dp x ep x cp) of the rows; e.g. [ep] keeps a replica of
    the tables on every data-parallel replica and splits them over its expert-parallel ranks"""
    engram_host_memory: bool = False
    """with engram_shard: keep each rank's block of Engram rows and its AdamW state in (pinned) host memory, rows and
    row gradients crossing to the device per micro-batch (DeepSeek's Engram cpu_offload)"""
    activation_checkpoint: str = choice_field("none", ACTIVATION_CHECKPOINT_MODES)
    """full: every transformer block keeps only its inputs for the backward and recomputes its forward there (one
    more forward per step, collectives included; trainer/parallel/activation_checkpoint.py); none: every block keeps
    its activations (Megatron --recompute-granularity full --recompute-method uniform --recompute-num-layers 1)"""
    timeout_s: float = 600.0
    """collective timeout: a rank whose peer died or hangs raises after this many seconds instead of waiting
    forever (Megatron --distributed-timeout-minutes, default 10 minutes)"""

    def __post_init__(self) -> None:
        if self.dp_replicate == 0 or self.dp_replicate < -1:
            raise ValueError(f"parallel.dp_replicate must be >= 1 or -1 (fill), got {self.dp_replicate}")
        for name in ("dp_shard", "tp", "pp", "pp_virtual", "ep", "cp"):
            at_least(f"parallel.{name}", getattr(self, name), 1)
        at_least("parallel.ep_capacity_factor", self.ep_capacity_factor, 0.0)
        check_choices(self, "parallel")
        positive("parallel.timeout_s", self.timeout_s)
        if self.pp_schedule == "1F1B" and self.pp_virtual != 1:
            raise ValueError(f"parallel.pp_schedule=1F1B runs one stage per pipeline rank, got "
                             f"parallel.pp_virtual={self.pp_virtual}: set parallel.pp_schedule=Interleaved1F1B "
                             "(or InterleavedZeroBubble, ZBVZeroBubble with pp_virtual=2)")
        if self.pp_schedule == "ZBVZeroBubble" and self.pp_virtual != 2:
            raise ValueError(f"parallel.pp_schedule=ZBVZeroBubble places exactly two stages on each pipeline rank "
                             f"(a V), got parallel.pp_virtual={self.pp_virtual}: set parallel.pp_virtual=2")
        if self.pp_cuts and len(self.pp_cuts) != self.pp * self.pp_virtual - 1:
            raise ValueError(f"parallel.pp_cuts={list(self.pp_cuts)} must hold pp * pp_virtual - 1 = "
                             f"{self.pp * self.pp_virtual - 1} layer indices (or be [] for the balanced split)")
        wrong = [a for a in self.engram_shard_over if a not in ENGRAM_SHARD_AXES]
        if wrong or not self.engram_shard_over or len(set(self.engram_shard_over)) != len(self.engram_shard_over):
            raise ValueError(f"parallel.engram_shard_over={list(self.engram_shard_over)} must name distinct axes among "
                             f"{list(ENGRAM_SHARD_AXES)}, at least one")
        if self.engram_host_memory and not self.engram_shard:
            raise ValueError("parallel.engram_host_memory=true keeps a rank's block of Engram rows on the host and "
                             "needs parallel.engram_shard=true (whole replicated tables stay on the device)")

    def resolve(self, world_size: int) -> ParallelDims:
        """Concrete sizes for `world_size` processes, checked to multiply to it."""
        others = self.dp_shard * self.tp * self.pp * self.ep * self.cp
        sizes = f"{self.dp_shard}*{self.tp}*{self.pp}*{self.ep}*{self.cp}"
        if self.dp_replicate == -1:
            if world_size % others:
                raise ValueError(
                    f"parallel: dp_shard*tp*pp*ep*cp = {sizes} = {others} does not divide the world size "
                    f"{world_size} (dp_replicate=-1 fills the rest): launch a multiple of {others} processes or "
                    "change the sizes")
            dp = world_size // others
        else:
            dp = self.dp_replicate
            if dp * others != world_size:
                raise ValueError(
                    f"parallel: dp_replicate*dp_shard*tp*pp*ep*cp = {dp}*{sizes} = {dp * others} must equal the "
                    f"world size {world_size}: launch {dp * others} processes, change the sizes, or set "
                    "parallel.dp_replicate=-1 to fill")
        return ParallelDims(dp_replicate=dp, dp_shard=self.dp_shard, tp=self.tp, pp=self.pp, ep=self.ep, cp=self.cp)


@dataclass(frozen=True)
class ParallelDims:
    """Validated, concrete parallel sizes (the object passed where parallelism matters)."""

    dp_replicate: int  # full model replicas
    dp_shard: int  # FSDP shards
    tp: int  # tensor parallel
    pp: int  # pipeline stages
    ep: int  # expert parallel
    cp: int  # context parallel

    @property
    def dp(self) -> int:
        """Data-parallel ranks that hold the same experts (dp_replicate x dp_shard)."""
        return self.dp_replicate * self.dp_shard

    @property
    def data(self) -> int:
        """Ranks that read different batches: dp_replicate x dp_shard x ep."""
        return self.dp * self.ep

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.ep * self.cp


@dataclass
class WandbConfig:
    mode: str = choice_field("offline", ("offline", "online", "disabled"))
    """offline writes the run under <run dir>/wandb/ (sync later with `wandb sync`); never needs the network"""
    project: str = "cedar"
    """W&B project"""
    entity: Optional[str] = None
    """W&B team or user; null = the account's default"""
    name: Optional[str] = None
    """run name; default: the run directory's name"""
    tags: list[str] = field(default_factory=list)
    """W&B run tags"""

    def __post_init__(self) -> None:
        check_choices(self, "logger.wandb")


@dataclass
class LoggerConfig:
    log_every: int = 1
    """write metrics every this many steps (1 = every step) to metrics.jsonl and W&B"""
    progress_bar: bool = True
    """tqdm bar on rank 0 (loss, tokens/s, MFU, ETA) when stderr is a terminal; off, or in a log file (Slurm), one
    plain line every log_every steps instead (step, loss, lr, tokens/s, MFU, ETA)"""
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        at_least("logger.log_every", self.log_every, 1)


@dataclass
class CheckpointConfig:
    interval: int = 100
    """save every this many steps; 0 = only the final save"""
    keep_last: int = 3
    """complete checkpoints kept under <run dir>/checkpoints/; older ones are deleted"""
    resume: str = "auto"
    """auto: newest complete checkpoint under <run dir>/checkpoints/, if any; none: start fresh; else a path"""
    save_final: bool = True
    """also save at trainer.max_steps"""
    async_save: bool = False
    """periodic saves write in a background thread while training goes on (torch.distributed.checkpoint's
    async_save): the step pays only for copying the state to host memory (which then holds a copy of this rank's
    state until the write ends); the checkpoint counts once every rank's write is done (at most one in flight; the
    last save and a stop's save wait). A crash mid-write leaves the previous checkpoint the newest complete one"""
    async_staging: str = choice_field("reused", ("reused", "fresh"))
    """where an asynchronous save copies the state: reused = host buffers allocated at the first save and kept for
    the run (page-locked when the state is on a GPU, so the copy runs at DMA speed), fresh = new pageable buffers
    each save, freed when the write ends (less host memory between saves, a slower copy)"""
    piece_mb: float = 256.0
    """a tensor (or a rank's shard of one) larger than this is stored as row ranges of at most this size: a partial
    read (a resharded resume, the Hugging Face export) then holds one piece, not the whole tensor, in host memory"""
    init_from: str = ""
    """start from another run's weights (a checkpoint directory, a run's checkpoints/ folder meaning its newest
    complete checkpoint, or a run directory; saved under any layout) when this run has no checkpoint of its own
    to resume; "" = initialise from trainer.seed. The optimiser starts fresh unless init_optimizer"""
    init_optimizer: bool = False
    """with init_from: also take the optimiser's moments (the same trainable parameters); the schedule and step
    count start at 0 either way"""

    def __post_init__(self) -> None:
        at_least("checkpoint.interval", self.interval, 0)
        at_least("checkpoint.keep_last", self.keep_last, 1)
        positive("checkpoint.piece_mb", self.piece_mb)
        check_choices(self, "checkpoint")
        if not self.resume:
            raise ValueError("checkpoint.resume must be 'auto', 'none' or a checkpoint path, got ''")


@dataclass
class Config:
    """The whole job: one section per component."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    stage: Any = field(default_factory=StageConfig)
    """a StageConfig, or the schema of the stage `stage.name` names (trainer/stages/config.py STAGE_SCHEMAS)"""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


_GROUPS = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "parallel": ParallelConfig,
    "stage": StageConfig,
    "logger": LoggerConfig,
    "checkpoint": CheckpointConfig,
}


def register_configs() -> None:
    """Register the schemas with Hydra: the root as `config_schema`, each group's as `<group>/schema`
    (every group YAML starts with `defaults: [schema, _self_]`). Idempotent."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, node in _GROUPS.items():
        cs.store(group=group, name="schema", node=node)
    for name, node in STAGE_SCHEMAS.items():  # conf/stage/<name>.yaml: defaults [<name>_schema, _self_]
        cs.store(group="stage", name=f"{name}_schema", node=node)

    cs.store(group="data", name="multimodal_schema", node=MultimodalDataConfig)  # conf/data/multimodal.yaml


def _stage_schema(stage: dict):
    name = stage.get("name", "pretrain")
    if name not in STAGE_SCHEMAS:
        raise ValueError(f"stage.name={name!r} is not implemented: choose one of {sorted(STAGE_SCHEMAS)} (stage=<name>)")
    return STAGE_SCHEMAS[name]


def unknown_key_message(full_key: str, keys) -> str:
    """`unknown key trainer.max_step (did you mean trainer.max_steps?)`: a key its section lacks, with the closest of
    the section's `keys` (difflib); without a close one, the section's keys."""
    section, _, name = full_key.rpartition(".")
    keys = [str(k) for k in keys if k != "hydra"]
    close = difflib.get_close_matches(name, keys, n=1)
    if close:
        return f"unknown key {full_key} (did you mean {section + '.' if section else ''}{close[0]}?)"
    return f"unknown key {full_key}; the keys of {section or 'the config'}: {', '.join(keys)}"


def key_error_message(e: Exception, prefix: str = "") -> str | None:
    """One line for an OmegaConf error about one key (`prefix` + its full key): an unknown key with the closest
    valid one, a value of the wrong type with its key; None for any other error."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    key = getattr(e, "full_key", None)
    if not key:
        return None
    if isinstance(e, (ConfigKeyError, ConfigAttributeError)):
        parent = getattr(e, "parent_node", None)
        return unknown_key_message(prefix + key, parent.keys() if parent is not None else [])
    if isinstance(e, ValidationError):
        lines = str(e).strip().splitlines()
        return f"{prefix + key}: {lines[0] if lines else type(e).__name__}"
    return None


def to_config(node) -> Config:
    """The composed Hydra node as a typed, validated `Config`.

    Merging onto a fresh schema refuses keys the schema lacks: Hydra's `+key=value` can append them even in
    struct mode, and `OmegaConf.to_object` would drop them silently. Then `to_object` runs every
    `__post_init__`. Raises ValueError (one line, naming the full key) for either kind of mistake.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        plain = OmegaConf.to_container(node, resolve=True)  # drops the node types that carry the extra keys
        stage = plain.pop("stage", None) or {}
        data = plain.get("data") or {}
        if "multimodal" in data:  # conf/data/multimodal.yaml: the data section against its own schema

            plain.pop("data")
        merged = OmegaConf.merge(OmegaConf.structured(Config), plain)
        if "multimodal" in data:
            merged.data = OmegaConf.merge(OmegaConf.structured(MultimodalDataConfig), data)
    except OmegaConfBaseException as e:
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(key_error_message(e) or f"{first_line} (full key: {e.full_key})") from None
    try:  # the stage section against the schema its name selects (a dict node of its own: keys without "stage.")
        merged.stage = OmegaConf.merge(OmegaConf.structured(_stage_schema(stage)), stage)
    except OmegaConfBaseException as e:
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(key_error_message(e, "stage.") or f"{first_line} (full key: stage.{e.full_key})") from None
    return OmegaConf.to_object(merged)
