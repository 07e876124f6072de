"""The stage seam: what changes between pretraining, SFT, RL, distillation and drafter training, behind one loop.

A `Stage` (chosen by `stage.name`, `STAGES`) supplies, to trainer/train.py's one loop:
- `model_config(cfg)`: its transforms of the model config (the post-training hooks, e.g. FP4 main-KV QAT);
- `batches(cfg, data_rank, data_ranks, progress=)`: the loader of its batches (dicts of [B, T] tensors: input_ids, labels,
  -100 where a token takes no part in the loss, and optionally image_mask and loss_weights; a multimodal batch also
  pixel_values, grids and row_kind, data/multimodal.py) and the tokenizer;
- `loss()`: its loss (trainer/loss.py; `LMLoss` normalises over the global batch's valid tokens and takes per-token
  weights), used by the plain and the pipeline paths alike;
- `trainable_parameters(module, model_cfg)`: what the optimiser owns;
- `callbacks()`: its trainer/callbacks.py callbacks, run at every point of the loop after the router-bias update
  and before the metrics record and the periodic checkpoint.

Pretraining is the first implementation; SFT, RL, distillation and DSpark drafter training live in trainer/stages/.
A stage whose batches need the model (RL's rollouts) also has `bind(job)`, called once the job is built. Optional
seams a stage may have (trainer/train.py reads them): `check_layout(parallel)` and `check(cfg)` (its rules, before
any process group), `build_module(cfg)` (what is built, trained and saved instead of the Transformer: dspark's
drafter), `reads_init_from = True` (checkpoint.init_from is the stage's own frozen model, not the starting weights),
`forward_backward(pm, batches, autocast_dtype, loss)` (its own step forward, as trainer/train.py's), and
`flops_per_token(cfg)` (for MFU).
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
        from model.layer_plan import build_layer_plan

        build_layer_plan(cfg)  # the pool's rules (a Full source layer, top-k within the pool) fail here, named
    return cfg


class _ReplayCutBatches:
    """A loader whose batches carry `replay_cuts` (model/replay.py), drawn from each sequence's tokens."""

    def __init__(self, loader, stage: StageConfig, window: int, seed: int):
        self.loader, self.stage, self.window, self.seed = loader, stage, window, seed

    def __iter__(self):
        from model.replay import sample_cuts

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


class Pretrain:
    """Next-token prediction on packed webdataset shards (data/), every parameter trained (the indexers alone in
    the dense warm-up phase)."""

    name = "pretrain"

    def __init__(self, stage: StageConfig):
        self.stage = stage

    def model_config(self, cfg: ModelConfig) -> ModelConfig:
        return apply_model_hooks(self.stage, cfg)

    def batches(self, cfg: Config, data_rank: int, data_ranks: int, *, progress: bool = False):
        from data.config import build_dataloader, ensure_prepared

        if hasattr(cfg.data, "multimodal"):  # data=multimodal: text and image-text rows (data/multimodal.py)
            from data.multimodal import build_multimodal_loader

            loader = build_multimodal_loader(cfg.data, data_rank, data_ranks, progress=progress)
            return with_replay_cuts(loader, self.stage, cfg)
        ensure_prepared(cfg.data, progress=progress)  # node-safe: one process prepares, the others wait
        loader = build_dataloader(cfg.data, data_rank, data_ranks)
        return with_replay_cuts(loader, self.stage, cfg)

    def loss(self) -> LMLoss:
        from trainer.loss import LMLoss

        return LMLoss()

    def trainable_parameters(self, module: torch.nn.Module, cfg: ModelConfig) -> list[torch.nn.Parameter]:
        return indexer_or_all_parameters(module, cfg)

    def callbacks(self) -> list[Callback]:
        return []


def _post_training(module: str, cls: str):
    def make(stage):
        import importlib

        return getattr(importlib.import_module(f"trainer.stages.{module}"), cls)(stage)

    return make


STAGES = {"pretrain": Pretrain, "sft": _post_training("sft", "SFT"), "rl": _post_training("rl", "RL"),
          "distill": _post_training("distill", "Distill"), "dspark": _post_training("dspark", "DSparkStage")}


def build_stage(stage: StageConfig) -> Stage:
    """The Stage named by stage.name."""
    if stage.name not in STAGES:
        raise ValueError(f"stage.name={stage.name!r} is not implemented yet; only {sorted(STAGES)} run")
    return STAGES[stage.name](stage)
