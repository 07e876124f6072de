"""The stage seam: what changes between pretraining, SFT, RL, distillation and drafter training, behind one loop.

A `Stage` (chosen by `stage.name`, `STAGES`) supplies, to trainer/train.py's one loop:
- `model_config(cfg)`: its transforms of the model config (the post-training hooks, e.g. FP4 main-KV QAT);
- `batches(cfg, data_rank, data_ranks, progress=)`: the loader of its batches (dicts of [B, T] tensors: input_ids, labels,
  -100 where a token takes no part in the loss, and optionally image_mask and loss_weights) and the tokenizer;
- `loss()`: its loss (trainer/loss.py; `LMLoss` normalises over the global batch's valid tokens and takes per-token
  weights), used by the plain and the pipeline paths alike;
- `trainable_parameters(module, model_cfg)`: what the optimiser owns;
- `callbacks()`: its trainer/callbacks.py callbacks, run at every point of the loop after the router-bias update
  and before the metrics record and the periodic checkpoint.

Pretraining is the first implementation; the others are named in StageConfig and raise until their issue lands.
A new stage is a class with these five methods, registered in `STAGES` (docs/data_flow.md has a 20-line example).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from model.config import ModelConfig
    from trainer.callbacks import Callback
    from trainer.config import Config, StageConfig
    from trainer.loss import LMLoss

__all__ = ["Stage", "Pretrain", "STAGES", "build_stage", "indexer_or_all_parameters"]


class Stage(Protocol):
    name: str

    def model_config(self, cfg: ModelConfig) -> ModelConfig: ...

    def batches(self, cfg: Config, data_rank: int, data_ranks: int, *, progress: bool = False): ...

    def loss(self) -> LMLoss: ...

    def trainable_parameters(self, module: torch.nn.Module, cfg: ModelConfig) -> list[torch.nn.Parameter]: ...

    def callbacks(self) -> list[Callback]: ...


def indexer_or_all_parameters(module: torch.nn.Module, cfg: ModelConfig) -> list[torch.nn.Parameter]:
    """Every parameter of `module` (a Transformer or a pipeline StageGroup), or only the indexers in the dense
    warm-up phase (Transformer.trainable_parameters' rule)."""
    if cfg.indexer.phase == "dense_warmup":
        layers = module.layers.values() if isinstance(module.layers, torch.nn.ModuleDict) else module.layers
        return [p for layer in layers if layer.attn.indexer is not None for p in layer.attn.indexer.parameters()]
    return [p for p in module.parameters() if p.requires_grad]


class Pretrain:
    """Next-token prediction on packed webdataset shards (data/), every parameter trained (the indexers alone in
    the dense warm-up phase)."""

    name = "pretrain"

    def __init__(self, stage: StageConfig):
        self.stage = stage

    def model_config(self, cfg: ModelConfig) -> ModelConfig:
        if self.stage.bounded_replay:
            raise ValueError("stage.bounded_replay=true needs the model's replay simulation, which is not there yet")
        if self.stage.fp4_qat:  # FP4 fake-quant of the main KV in every forward (SPEC 1.4)
            return dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, main_kv="fp4"))
        return cfg

    def batches(self, cfg: Config, data_rank: int, data_ranks: int, *, progress: bool = False):
        from data.config import build_dataloader, ensure_prepared

        ensure_prepared(cfg.data, progress=progress)  # node-safe: one process prepares, the others wait
        return build_dataloader(cfg.data, data_rank, data_ranks)

    def loss(self) -> LMLoss:
        from trainer.loss import LMLoss

        return LMLoss()

    def trainable_parameters(self, module: torch.nn.Module, cfg: ModelConfig) -> list[torch.nn.Parameter]:
        return indexer_or_all_parameters(module, cfg)

    def callbacks(self) -> list[Callback]:
        return []


STAGES = {"pretrain": Pretrain}


def build_stage(stage: StageConfig) -> Stage:
    """The Stage named by stage.name."""
    if stage.name not in STAGES:
        raise ValueError(f"stage.name={stage.name!r} is not implemented yet; only {sorted(STAGES)} run")
    return STAGES[stage.name](stage)
