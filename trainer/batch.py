"""A loader batch on this rank: its compute device, its tensors moved there, its context-parallel chunk.

What the loop (trainer/train.py) and the stages that run their own forwards (trainer/stages/) share.
"""

from __future__ import annotations

import torch

from trainer.parallel.apply import ParallelModel
from trainer.parallel.context import shard_sequence

__all__ = ["compute_device", "to_device", "local_chunk"]


def compute_device(pm: ParallelModel) -> torch.device:
    """The compute device (host-resident Engram rows, parallel.engram_host_memory, are not it)."""
    devices = [p.device for p in pm.module.parameters()]
    return next((d for d in devices if d.type != "cpu"), devices[0])


def to_device(batch: dict, device: torch.device):
    """A loader batch -> (input_ids [B, T], labels [B, T], image_mask [B, T] or None, loss_weights [B, T] or None)
    on `device`."""
    mask, weights = batch.get("image_mask"), batch.get("loss_weights")
    return (
        batch["input_ids"].to(device, non_blocking=True),
        batch["labels"].to(device, non_blocking=True),
        None if mask is None else mask.to(device, non_blocking=True),
        None if weights is None else weights.to(device, non_blocking=True),
    )


def local_chunk(pm: ParallelModel, *tensors):
    """This rank's context-parallel chunk of each [B, T] tensor (None passes); the tensors as they are otherwise."""
    if pm.dims.cp == 1:
        return tensors
    return tuple(None if t is None else shard_sequence(t, pm.meshes.cp) for t in tensors)
