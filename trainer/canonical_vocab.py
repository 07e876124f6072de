"""The Engram hasher's canonical vocabulary (REFERENCE A8), derived from the tokenizer a run trains with: the one
map training (trainer/train.py) and loading a checkpoint (trainer/checkpoint/loading.py) install alike."""

from __future__ import annotations

import torch

from data.tokenizer import load_tokenizer
from model.config import ModelConfig
from model.engram import canonical_vocab_from_tokenizer

__all__ = ["install_canonical_vocab"]


def install_canonical_vocab(model: torch.nn.Module, cfg: ModelConfig, tokenizer_path: str) -> None:
    """Engram hashes canonical ids (REFERENCE A8): derive the map from the tokenizer the shards were made with.
    It is a pure function of the tokenizer, so a resumed run recomputes the same map."""
    if not cfg.engram.layers:
        return
    mapping, num_canonical = canonical_vocab_from_tokenizer(load_tokenizer(tokenizer_path), cfg.vocab_size)
    if num_canonical > cfg.engram.compressed_vocab_size:
        raise ValueError(
            f"model.engram.compressed_vocab_size={cfg.engram.compressed_vocab_size} is smaller than the "
            f"{num_canonical} canonical ids of tokenizer {tokenizer_path}"
        )
    hasher = getattr(model, "hasher", None)  # only the first pipeline stage hashes
    if hasher is not None:
        hasher.set_canonical_map(mapping)
