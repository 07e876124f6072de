"""Build the job's DeviceMesh from validated parallel sizes."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")


@dataclass(frozen=True)
class Meshes:
    """The world mesh and the (flattened) sub-meshes the plans use.

    - world: all six axes;
    - pp, tp, ep, cp, dp_shard: one axis each;
    - dp: dp_replicate x dp_shard (gradient reduction of expert weights; FSDP);
    - data: dp_replicate x dp_shard x ep (ranks that read different batches);
    - dp_ep_cp: dp_replicate x dp_shard x ep x cp (gradient reduction of non-expert weights; the group Engram
      tables are row-sharded over with parallel.engram_shard).
    """

    world: DeviceMesh
    pp: DeviceMesh
    tp: DeviceMesh
    ep: DeviceMesh
    cp: DeviceMesh
    dp_shard: DeviceMesh
    dp: DeviceMesh
    data: DeviceMesh
    dp_ep_cp: DeviceMesh


def build_mesh(dims, device_type: str) -> Meshes:
    """dims: an object with integer attributes named like AXES (trainer.config.ParallelDims)."""
    sizes = tuple(getattr(dims, axis) for axis in AXES)
    world = init_device_mesh(device_type, sizes, mesh_dim_names=AXES)
    return Meshes(
        world=world, pp=world["pp"], tp=world["tp"], ep=world["ep"], cp=world["cp"], dp_shard=world["dp_shard"],
        dp=world["dp_replicate", "dp_shard"]._flatten("dp"),
        data=world["dp_replicate", "dp_shard", "ep"]._flatten("data"),
        dp_ep_cp=world["dp_replicate", "dp_shard", "ep", "cp"]._flatten("dp_ep_cp"),
    )
