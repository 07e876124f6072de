"""The stage seam: what changes between pretraining, SFT, RL, distillation and drafter training, behind one loop.

Contract: `Stage` declares every hook trainer/train.py's one loop calls, each with its default; a stage (chosen by
`stage.name`, registered once in `STAGES`) overrides what it changes. Required:
`batches(cfg, data_rank, data_ranks, progress=)`, the loader of its batches (dicts of [B, T] tensors: input_ids,
labels with -100 where a token takes no part in the loss, optionally image_mask, loss_weights and the multimodal
tensors) and the tokenizer. With defaults: `model_config`, `check_layout`, `check`, `build_module`, `loss`,
`trainable_parameters`, `callbacks`, `bind`, `flops_per_token`, `forward_backward`, `reads_init_from`
(docs/stages.md says what each means). Pretraining is the first implementation (`Pretrain`); `build_stage` makes the
configured one.

Design and reasoning: docs/stages.md#the-stage-seam
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING

import torch

import model as model_pkg
from data.config import build_dataloader, ensure_prepared
from data.multimodal import build_multimodal_loader
from model.config import ModelConfig
from model.layer_plan import build_layer_plan
from model.replay import sample_cuts
from trainer.loss import LMLoss
from trainer.stages.config import PostTrainingConfig

if TYPE_CHECKING:
    from trainer.callbacks import Callback
    from trainer.config import Config, ParallelConfig, StageConfig

__all__ = ["Stage", "Pretrain", "STAGES", "build_stage", "check_starting_weights", "indexer_or_all_parameters"]


def indexer_or_all_parameters(module: torch.nn.Module, cfg: ModelConfig) -> list[torch.nn.Parameter]:
    """Every parameter of `module` (a Transformer or a pipeline StageGroup), or only the indexers in the dense
    warm-up phase (Transformer.trainable_parameters' rule)."""
    if cfg.indexer.phase == "dense_warmup":
        layers = module.layers.values() if isinstance(module.layers, torch.nn.ModuleDict) else module.layers
        return [p for layer in layers if layer.attn.indexer is not None for p in layer.attn.indexer.parameters()]
    return [p for p in module.parameters() if p.requires_grad]


def apply_model_hooks(stage: StageConfig, cfg: ModelConfig) -> ModelConfig:
    """The model config with the stage's hooks on (SPEC 2: post-training switches). fp4_kv_qat fake-quantises
    each cached tensor in the format its cache stores (a bf16 or unquantised store has no fake-quant to mirror);
    hierarchical_indexer turns the candidate pool on."""
    if stage.fp4_kv_qat:
        q = cfg.quant
        cfg = dataclasses.replace(cfg, quant=dataclasses.replace(
            q, main_kv="fp4" if q.cache_main_kv == "fp4" else q.main_kv,
            index="fp4" if q.cache_index == "fp4" else q.index,
            swa_kv="fp8" if q.cache_swa_kv == "fp8" else q.swa_kv))
    if stage.hierarchical_indexer:
        cfg = dataclasses.replace(cfg, csa2=dataclasses.replace(cfg.csa2, hierarchical_pool=True))
        build_layer_plan(cfg)  # the pool's rules (a Full source layer, top-k within the pool) fail here, named
    return cfg


class _ReplayCutBatches:
    """A loader whose batches carry `replay_cuts` (model/replay.py), drawn from each sequence's tokens."""

    def __init__(self, loader, stage: StageConfig, window: int, seed: int):
        self.loader, self.stage, self.window, self.seed = loader, stage, window, seed

    def __iter__(self):
        for batch in self.loader:
            batch = dict(batch)
            batch["replay_cuts"] = sample_cuts(batch["input_ids"], self.window, self.stage.replay_sim_prob,
                                               tuple(self.stage.replay_sim_kinds), self.seed)
            yield batch

    def __getattr__(self, name):  # state_dict, load_state_dict, tokenizer ...: the loader's
        return getattr(self.loader, name)


def with_replay_cuts(loader, stage: StageConfig, cfg: Config):
    """The stage's loader, its batches with sampled replay cuts when stage.bounded_replay_sim is on."""
    if not stage.bounded_replay_sim:
        return loader
    if cfg.parallel.pp > 1 or cfg.parallel.cp > 1:
        raise ValueError("stage.bounded_replay_sim=true runs without pipeline or context parallelism "
                         f"(parallel.pp={cfg.parallel.pp}, parallel.cp={cfg.parallel.cp})")
    if isinstance(loader, tuple):
        return (_ReplayCutBatches(loader[0], stage, cfg.model.attention.window, cfg.trainer.seed), *loader[1:])
    return _ReplayCutBatches(loader, stage, cfg.model.attention.window, cfg.trainer.seed)


class Stage:
    """Every hook the training loop calls, with its default (docs/stages.md#the-stage-seam lists them); `batches` has
    none."""

    name: str = ""
    reads_init_from: bool = False
    """True: checkpoint.init_from is the stage's own frozen model (dspark's backbone), not the starting weights"""
    progress_keys: tuple[str, ...] = ()
    """the step's figures (keys of its metrics record) that the progress line shows after the loss: the headline"""
    forward_backward = None
    """None: the loop's forward and backward (trainer/train.py `forward_backward`); else the stage's own, with its
    signature and result (dspark's runs the frozen backbone, then the drafter)"""

    def __init__(self, stage: StageConfig):
        self.stage = stage

    def model_config(self, cfg: ModelConfig) -> ModelConfig:
        return apply_model_hooks(self.stage, cfg)

    def check_layout(self, parallel: ParallelConfig) -> None:
        """Its rules on the layout (RL's rollouts need the whole model): ValueError naming the key."""

    def check(self, cfg: Config) -> None:
        """Its rules on the rest of the job (dspark needs its backbone): ValueError naming the key."""

    def batches(self, cfg: Config, data_rank: int, data_ranks: int, *, progress: bool = False):
        raise NotImplementedError(f"stage {self.name!r} gives no batches")

    def build_module(self, cfg: ModelConfig) -> torch.nn.Module:
        return model_pkg.build(cfg)

    def loss(self) -> LMLoss:
        return LMLoss()

    def trainable_parameters(self, module: torch.nn.Module, cfg: ModelConfig) -> list[torch.nn.Parameter]:
        return indexer_or_all_parameters(module, cfg)

    def callbacks(self) -> list[Callback]:
        return []

    def bind(self, job) -> None:
        """Called once the job is built (trainer/train.py `Job`)."""

    def flops_per_token(self, cfg: ModelConfig):
        """seq_len -> training FLOPs per token of the whole model (model/accounting.py), whatever this rank holds."""
        with torch.device("meta"):
            return model_pkg.build(cfg).flops_per_token


class Pretrain(Stage):
    """Next-token prediction on packed webdataset shards (data/), every parameter trained (the indexers alone in
    the dense warm-up phase)."""

    name = "pretrain"

    def batches(self, cfg: Config, data_rank: int, data_ranks: int, *, progress: bool = False):
        if hasattr(cfg.data, "multimodal"):  # data=multimodal: text and image-text rows (data/multimodal.py)
            loader = build_multimodal_loader(cfg.data, data_rank, data_ranks, progress=progress)
            return with_replay_cuts(loader, self.stage, cfg)
        ensure_prepared(cfg.data, progress=progress)  # node-safe: one process prepares, the others wait
        loader = build_dataloader(cfg.data, data_rank, data_ranks)
        return with_replay_cuts(loader, self.stage, cfg)


def check_starting_weights(cfg: Config) -> None:
    """A post-training stage (sft, rl, distill) trains the weights it starts from: without checkpoint.init_from it
    would post-train a random model, which is refused in one line unless stage.allow_random_init=true (dspark
    refuses a missing backbone the same way, trainer/stages/dspark.py)."""
    if isinstance(cfg.stage, PostTrainingConfig) and not cfg.checkpoint.init_from and not cfg.stage.allow_random_init:
        raise ValueError(f"stage={cfg.stage.name} post-trains the weights it starts from: set checkpoint.init_from="
                         "<a checkpoint, run directory or Hugging Face directory> (or stage.allow_random_init=true to "
                         "start from random weights)")


def _post_training(module: str, cls: str):
    """The stage class `cls` of trainer/stages/<module>.py, imported when chosen: pretraining loads none of what the
    post-training stages import (the engine, the environments)."""

    def make(stage):
        return getattr(importlib.import_module(f"trainer.stages.{module}"), cls)(stage)

    return make


STAGES = {"pretrain": Pretrain, "sft": _post_training("sft", "SFT"), "rl": _post_training("rl", "RL"),
          "distill": _post_training("distill", "Distill"), "dspark": _post_training("dspark", "DSparkStage")}


def build_stage(stage: StageConfig) -> Stage:
    """The Stage named by stage.name."""
    if stage.name not in STAGES:
        raise ValueError(f"stage.name={stage.name!r} is not implemented yet; only {sorted(STAGES)} run")
    return STAGES[stage.name](stage)
