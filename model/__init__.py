"""Cedar's model package: architecture only (no process groups, logging or file I/O).

`build(cfg)` returns the V4.1 backbone on the current default device (meta works); call `init_weights()` after
materialising it (`to_empty`), as the trainer does.
"""

from __future__ import annotations

from model.config import ModelConfig


def to_model_config(cfg) -> ModelConfig:
    """Accept a ModelConfig or an OmegaConf node of the `model` group (validated through the dataclass)."""
    if isinstance(cfg, ModelConfig):
        return cfg
    from omegaconf import OmegaConf

    node = OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg)
    return OmegaConf.to_object(node)


def build(cfg):
    from model.transformer import Transformer  # start-up: `import model.config` (the schemas) stays free of torch

    return Transformer(to_model_config(cfg))


__all__ = ["ModelConfig", "build", "to_model_config"]
