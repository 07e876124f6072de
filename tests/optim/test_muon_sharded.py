"""The Hybrid optimiser (optim/hybrid.py) on DTensor parameters equals it on plain ones: the same parameters and
gradients, sharded every way a layout shards them, give the single process's parameters and optimiser state after
two steps (fp32 on gloo, to rounding). 4 ranks, a 2 x 2 mesh and its two 1-D sub-meshes:
- Muon blocks each rank holds whole, updated with no communication: stacked experts sharded on the expert dim (ep),
  head-wise Q rows sharded by heads (tp), a replicated matrix;
- Muon matrices an owner gathers (one gather, one scatter): row shards (FSDP2), uneven row shards (7 rows over 2),
  column shards (tp), row x column shards over the 2-D mesh, head-wise rows whose shard splits a head;
- Sinkhorn tables sharded on rows (the Engram tables, a vocabulary-parallel embedding), on columns, and both;
- AdamW on a row-sharded matrix and a replicated vector.
Each rank's owner plan is the same (as places in each mesh) and the cost balance spreads the owners."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from optim.hybrid import Hybrid
from tests.distributed import run_distributed

MUON = dict(kind="muon", lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=True, rms=0.2)
SINK = dict(kind="sinkhorn", lr=0.1, weight_decay=0.1, momentum=0.9, nesterov=True, rms=0.2, iters=8)
ADAM = dict(kind="adamw", lr=0.01, weight_decay=0.1)

# name: (shape, group, head_rows, mesh ("2d", "rows", "cols"), placements)
CASES = {
    "experts_ep": ((4, 6, 8), MUON, None, "rows", [Shard(0)]),
    "q_heads_tp": ((4 * 4, 10), MUON, 4, "rows", [Shard(0)]),
    "replicated": ((12, 20), MUON, None, "2d", [Replicate(), Replicate()]),
    "fsdp_rows": ((12, 20), MUON, None, "rows", [Shard(0)]),
    "uneven_rows": ((7, 20), MUON, None, "cols", [Shard(0)]),
    "tp_cols": ((12, 20), MUON, None, "cols", [Shard(1)]),
    "rows_x_cols": ((12, 20), MUON, None, "2d", [Shard(0), Shard(1)]),
    "split_heads": ((2 * 4, 10), MUON, 4, "2d", [Shard(0), Shard(0)]),
    "table_rows": ((50, 16), SINK, None, "rows", [Shard(0)]),
    "table_cols": ((50, 16), SINK, None, "cols", [Shard(1)]),
    "table_2d": ((50, 16), SINK, None, "2d", [Shard(0), Shard(1)]),
    "adam_rows": ((12, 20), ADAM, None, "rows", [Shard(0)]),
    "adam_vec": ((20,), ADAM, None, "2d", [Replicate(), Replicate()]),
}


def _data(name: str, shape, step: int | None) -> torch.Tensor:
    """The parameter's initial value (step None) or its gradient at `step`, the same on every rank; table gradients
    reach some rows only."""
    seed = sum(map(ord, name)) * 10 + (0 if step is None else step + 1)
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    if step is not None and name.startswith("table"):
        t[torch.randperm(shape[0], generator=torch.Generator().manual_seed(seed))[:35]] = 0
    return t


def _groups(params: dict) -> list[dict]:
    return [dict(params=[params[n]], head_rows=CASES[n][2], **CASES[n][1]) if CASES[n][1] is MUON
            else dict(params=[params[n]], **CASES[n][1]) for n in CASES]


def _run(params: dict) -> dict:
    opt = Hybrid(_groups(params), dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, fused=False, foreach=False))
    for step in range(2):
        for n, p in params.items():
            g = _data(n, CASES[n][0], step)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
        opt.step()
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in params.items()}
    state = {n: {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in opt.state[p].items()
                 if torch.is_tensor(v) and v.ndim > 0} for n, p in params.items()}
    # each owner as its place among its mesh's ranks (two ranks' sub-meshes "a" hold different ranks)
    owners = {n: opt._owners[id(p)].ranks.index(opt._owners[id(p)].owner) for n, p in params.items()
              if id(p) in opt._owners}
    return {"params": full, "state": state, "owners": owners}


def _worker(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    meshes = {"2d": mesh, "rows": mesh["a"], "cols": mesh["b"]}
    params = {}
    for n, (shape, _, _, which, placements) in CASES.items():
        params[n] = torch.nn.Parameter(distribute_tensor(_data(n, shape, None), meshes[which], placements))
    return _run(params)


def _single() -> dict:
    return _run({n: torch.nn.Parameter(_data(n, shape, None)) for n, (shape, *_) in CASES.items()})


@pytest.mark.distributed
def test_sharded_parameters_update_as_the_single_process():
    want = _single()
    got = run_distributed(_worker, 4)
    for r, res in enumerate(got):
        assert res["owners"] == got[0]["owners"]
        for n in CASES:
            torch.testing.assert_close(res["params"][n], want["params"][n], rtol=0, atol=2e-6, msg=f"rank {r} {n}")
            assert res["state"][n].keys() == want["state"][n].keys(), n
            for k in want["state"][n]:  # momentum buffers (DTensors like their parameter), AdamW's moments
                torch.testing.assert_close(res["state"][n][k], want["state"][n][k], rtol=0, atol=2e-6,
                                           msg=f"rank {r} {n} {k}")
    owned = got[0]["owners"]
    # the blocks a rank holds whole need no owner; the others have one, and more than one rank owns some
    assert not {"experts_ep", "q_heads_tp", "replicated"} & owned.keys()
    assert {"fsdp_rows", "uneven_rows", "tp_cols", "rows_x_cols", "split_heads"} <= owned.keys()
    assert len(set(owned.values())) > 1
