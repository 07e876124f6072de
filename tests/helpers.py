"""Shared test helpers: load a model config from conf/model and build a small model the way the trainer does."""

import dataclasses
from pathlib import Path

import torch
from omegaconf import OmegaConf

import model as model_pkg
from model.config import ModelConfig

ROOT = Path(__file__).resolve().parent.parent


def load_config(name: str, **overrides) -> ModelConfig:
    y = OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml")
    y.pop("defaults")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), y))
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def build_tiny(seed: int = 0, **overrides):
    """v41_tiny built on meta, materialised on CPU and initialised (fp32)."""
    cfg = load_config("v41_tiny", **overrides)
    torch.manual_seed(seed)
    with torch.device("meta"):
        m = model_pkg.build(cfg)
    m.to_empty(device="cpu")
    m.init_weights()
    return m
