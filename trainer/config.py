"""Typed job configuration: the schema Hydra validates `conf/config.yaml` and every config group against.

The root `Config` has one section per component; each component is handed only its own section, as a
dataclass instance made by `OmegaConf.to_object` so every `__post_init__` check has run. Struct mode
makes a misspelled key or a value of the wrong type fail at composition, naming the full key path.

OmegaConf 2.3 has no Literal support: closed sets are `str` fields checked in `__post_init__`, which
raise ValueError naming the key and the bad value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from data.config import DataConfig
from model.config import ModelConfig
from optim.config import OptimConfig


def _choice(key: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"{key} must be one of {list(options)}, got {value!r}")


def _at_least(key: str, value: int | float, low: int | float) -> None:
    if value < low:
        raise ValueError(f"{key} must be >= {low}, got {value!r}")


@dataclass
class TrainerConfig:
    max_steps: int = 300
    """optimiser steps of the whole run (a resumed run stops at the same step)"""
    grad_accum: int = 1
    """micro-batches per optimiser step"""
    grad_clip: float = 1.0
    """max global gradient L2 norm; 0 turns clipping off (the norm is still logged)"""
    seed: int = 0
    """weights are initialised from `seed` on every rank; per-rank randomness from seed + rank"""
    device: str = "auto"  # auto, cpu, cuda
    """auto: cuda when available, else cpu"""
    precision: str = "auto"  # auto, bf16, fp32
    """auto: bf16 autocast on GPU, fp32 on CPU. Parameters and optimiser state stay fp32 either way"""
    num_threads: int = 0
    """CPU threads per process; 0 = the cores divided by the processes on this node"""
    peak_flops: float = 0.0
    """peak FLOP/s of one device for MFU; 0 = a table for known GPUs, else measured by a matmul at start"""

    def __post_init__(self) -> None:
        _at_least("trainer.max_steps", self.max_steps, 1)
        _at_least("trainer.grad_accum", self.grad_accum, 1)
        _at_least("trainer.grad_clip", self.grad_clip, 0.0)
        _at_least("trainer.num_threads", self.num_threads, 0)
        _at_least("trainer.peak_flops", self.peak_flops, 0.0)
        _choice("trainer.device", self.device, ("auto", "cpu", "cuda"))
        _choice("trainer.precision", self.precision, ("auto", "bf16", "fp32"))


@dataclass
class ParallelConfig:
    """Sizes of the parallel dimensions; their product must equal the world size.

    Only replicated data parallelism runs today (gradients all-reduced); the other dimensions come in a
    later issue and are refused when > 1. dp_replicate = -1 takes whatever the other sizes leave.
    """

    dp_replicate: int = 1
    """data-parallel replicas (full copies of the model); -1 = world size / product of the others"""
    dp_shard: int = 1
    """FSDP shards (not yet supported)"""
    tp: int = 1
    """tensor (+ sequence) parallel size (not yet supported)"""
    pp: int = 1
    """pipeline stages (not yet supported)"""
    ep: int = 1
    """expert parallel size (not yet supported)"""
    cp: int = 1
    """context parallel size (not yet supported)"""

    _UNSUPPORTED = ("dp_shard", "tp", "pp", "ep", "cp")

    def __post_init__(self) -> None:
        if self.dp_replicate == 0 or self.dp_replicate < -1:
            raise ValueError(f"parallel.dp_replicate must be >= 1 or -1 (fill), got {self.dp_replicate}")
        for name in self._UNSUPPORTED:
            value = getattr(self, name)
            _at_least(f"parallel.{name}", value, 1)
            if value > 1:
                raise ValueError(
                    f"parallel.{name}={value} is not supported yet: only data parallelism "
                    f"(parallel.dp_replicate) runs in this version; set parallel.{name}=1"
                )

    def resolve(self, world_size: int) -> ParallelDims:
        """Concrete sizes for `world_size` processes, checked to multiply to it."""
        others = self.dp_shard * self.tp * self.pp * self.ep * self.cp
        dp = world_size // others if self.dp_replicate == -1 else self.dp_replicate
        if dp * others != world_size:
            raise ValueError(
                f"parallel: dp_replicate*dp_shard*tp*pp*ep*cp = {dp}*{self.dp_shard}*{self.tp}*{self.pp}*"
                f"{self.ep}*{self.cp} = {dp * others} must equal the world size {world_size}"
            )
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
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.ep * self.cp


@dataclass
class StageConfig:
    name: str = "pretrain"  # pretrain, sft, rl, distill, dspark
    """the training stage (SPEC 2); only pretrain runs in this version"""
    fp4_qat: bool = False
    """hook: fake-quantise the main KV to FP4 during training (post-training, SPEC 1.4)"""
    bounded_replay: bool = False
    """hook: simulate SWA bounded replay during training (post-training, SPEC 1.5)"""

    def __post_init__(self) -> None:
        _choice("stage.name", self.name, ("pretrain", "sft", "rl", "distill", "dspark"))


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline, online, disabled
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
        _choice("logger.wandb.mode", self.mode, ("offline", "online", "disabled"))


@dataclass
class LoggerConfig:
    log_every: int = 1
    """write metrics every this many steps (1 = every step) to metrics.jsonl and W&B"""
    progress_bar: bool = True
    """tqdm bar on rank 0 (loss, tokens/s, ETA)"""
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        _at_least("logger.log_every", self.log_every, 1)


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

    def __post_init__(self) -> None:
        _at_least("checkpoint.interval", self.interval, 0)
        _at_least("checkpoint.keep_last", self.keep_last, 1)
        if not self.resume:
            raise ValueError("checkpoint.resume must be 'auto', 'none' or a checkpoint path, got ''")


@dataclass
class Config:
    """The whole job: one section per component."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    stage: StageConfig = field(default_factory=StageConfig)
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
        merged = OmegaConf.merge(OmegaConf.structured(Config), plain)
    except OmegaConfBaseException as e:
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{first_line} (full key: {e.full_key})") from None
    return OmegaConf.to_object(merged)
