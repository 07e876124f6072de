"""Proves Engram row sharding (trainer/parallel/engram.py) computes what the unsharded table computes.

- The lookup alone (2 and 4 gloo ranks, rows that do not split evenly, random, repeated and one-sided ids): rows
  and table gradients equal the unsharded module's bit for bit, zero on rows nobody read; also the prefetch path,
  a stale prefetch, a lookup of other ids, host memory and bf16 tables.
- The whole tiny model on 2 data-parallel ranks: loss and gradients equal the single process within 1e-5 and plain
  data parallelism bit for bit; a DCP checkpoint loads into the unsharded model.
- tp 2 x dp 2: the loss within 1e-5 of the single process, table gradients bit for bit the replicated layout's.

In full: docs/testing.md#engram-row-sharding
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import model as model_pkg
from model.config import CSA2Config, EngramConfig, MHCConfig, ModelConfig
from model.engram import Engram
from tests.distributed import run_distributed
from tests.helpers import load_config
from trainer.config import ParallelDims
from trainer.parallel.engram import (
    ShardedRows,
    apply_engram_sharding,
    engram_tables,
    reduce_engram_gradients,
)
from trainer.parallel.mesh import build_mesh

# --- the lookup alone ------------------------------------------------------------------------------------------------

LAYER, B, T = 1, 2, 5  # 2 x 5 tokens per rank, 9 columns each: awkward sizes on purpose


def _cfg(table_dtype: str = "float32") -> ModelConfig:
    # 3 heads x 3 orders = 9 odd primes per layer: an odd row count, which 2 and 4 ranks cannot split evenly.
    e = EngramConfig(layers=[1, 2], max_ngram=4, num_heads=3, head_dim=8, prime_start=50,
                     compressed_vocab_size=300, pad_id=2, table_dtype=table_dtype)
    return ModelConfig(vocab_size=300, dim=16, num_layers=4, num_encoder_layers=2, image_token_id=299,
                       csa2=CSA2Config(compress_ratios=[0] * 4), mhc=MHCConfig(num_streams=3), engram=e)


def _engram(cfg, mesh=None, **kwargs) -> tuple[Engram, object]:
    torch.manual_seed(5)
    with torch.device("meta"):
        eng = Engram(cfg, LAYER)
    sharding = apply_engram_sharding(eng, mesh, **kwargs) if mesh is not None else None
    eng.to_empty(device="cpu")
    eng.init_weights()
    return eng, sharding


def _ids(scenario: str, world: int, num_rows: int, num_columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [world, B, T, C], rows nobody asks for [K]). Rank r looks up ids[r]."""
    gen = torch.Generator().manual_seed(17)
    perm = torch.randperm(num_rows, generator=gen)
    if scenario == "random":
        pool = perm[: 2 * num_rows // 3]  # a third of the rows is never asked for
        # drawn from a small part of the pool: repeats inside a rank and across ranks
        pick = torch.randint(0, len(pool) // 4, (world, B, T, num_columns), generator=gen)
        ids = pool[pick]
    else:  # one_sided: every id in rank 0's block
        ids = torch.randint(0, num_rows // world // 2, (world, B, T, num_columns), generator=gen)
    unused = torch.ones(num_rows, dtype=torch.bool)
    unused[ids.reshape(-1)] = False
    return ids, unused.nonzero().squeeze(1)


def _gathered_grad(table) -> torch.Tensor:
    return table.grad.full_tensor() if isinstance(table.grad, DTensor) else table.grad


def _lookup_worker(rank: int, world: int, table_dtype: str) -> dict:
    cfg = _cfg(table_dtype)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("engram",))
    ref, _ = _engram(cfg)
    eng, sharding = _engram(cfg, mesh)
    reader = eng.row_reader
    assert isinstance(reader, ShardedRows) and ref.num_rows % world != 0
    block = eng.table.to_local()
    assert block.shape == (reader.num_local, cfg.engram.head_dim)
    assert torch.equal(block, ref.table[reader.first_row:reader.first_row + reader.num_local])
    assert torch.equal(eng.table.full_tensor(), ref.table)
    assert torch.equal(eng.wkv.weight, ref.wkv.weight)  # the default generator stayed aligned after the table

    out = {}
    gen = torch.Generator().manual_seed(23)
    for scenario in ("random", "one_sided"):
        ids, unused = _ids(scenario, world, ref.num_rows, ref.num_columns)
        probe = torch.randn(world, B, T, ref.num_columns, cfg.engram.head_dim, generator=gen).to(ref.table.dtype)

        # The unsharded module: each rank's ids alone, gradients summed in rank order; and the whole batch at once.
        summed = torch.zeros_like(ref.table)
        for r in range(world):
            ref.table.grad = None
            (ref.lookup(ids[r]) * probe[r]).sum().backward()
            summed += ref.table.grad
        ref.table.grad = None
        (ref.lookup(ids) * probe).sum().backward()
        whole = ref.table.grad

        eng.table.grad = None
        rows = eng.lookup(ids[rank])
        assert torch.equal(rows, ref.table[ids[rank]]), scenario
        (rows * probe[rank]).sum().backward()
        grad = _gathered_grad(eng.table)
        assert torch.equal(grad, summed), scenario
        tol = dict(rtol=0, atol=1e-6) if table_dtype == "float32" else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(grad, whole, **tol)
        assert torch.equal(grad[unused], torch.zeros_like(grad[unused])) and len(unused) > 0, scenario
        assert grad[ids.unique()].abs().sum(-1).gt(0).all(), scenario  # every row read got a gradient

        # Prefetch: the exchange issued ahead gives the same rows and gradient.
        direct = eng.table.grad.to_local().clone()
        eng.table.grad = None
        sharding.prefetch_row_ids({LAYER: ids[rank]})
        assert len(reader.pending) == 1
        rows_pf = eng.lookup(ids[rank])
        assert not reader.pending
        assert torch.equal(rows_pf, rows), scenario
        (rows_pf * probe[rank]).sum().backward()
        assert torch.equal(eng.table.grad.to_local(), direct), scenario
        fetch = reader.issue(block.detach(), ids[rank])  # what each owner served (the test checks the scenarios)
        fetch.wait()
        out[scenario] = sum(fetch.recv_splits)

    # A prefetch made stale by an in-place update (the optimiser step) is re-issued: the lookup sees the new rows.
    ids, _ = _ids("random", world, ref.num_rows, ref.num_columns)
    sharding.prefetch_row_ids({LAYER: ids[rank]})
    with torch.no_grad():
        eng.table.to_local().add_(1.0)
    assert torch.equal(eng.lookup(ids[rank]), ref.table[ids[rank]] + 1.0)

    # Asking for other ids than the prefetched ones fails on every rank (no rank falls back alone).
    sharding.prefetch_row_ids({LAYER: ids[rank]})
    with pytest.raises(RuntimeError, match="prefetched"):
        eng.lookup(ids[rank].flip(0))

    # Host memory: the same rows and gradient (plain CPU memory on this machine).
    host, _ = _engram(cfg, mesh, host_memory=True)
    assert host.table.to_local().device.type == "cpu"
    rows = host.lookup(ids[rank])
    assert torch.equal(rows, ref.table[ids[rank]])
    (rows * 2).sum().backward()
    twice = torch.zeros_like(ref.table)
    for r in range(world):
        twice.index_add_(0, ids[r].reshape(-1), torch.full((ids[r].numel(), cfg.engram.head_dim), 2.0,
                                                            dtype=twice.dtype))
    assert torch.equal(_gathered_grad(host.table), twice)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_lookup_equals_unsharded(world):
    served = run_distributed(_lookup_worker, world, "float32")
    # The scenarios did what they claim: one-sided ids are all served by rank 0, random ones by every rank.
    assert served[0]["one_sided"] > 0 and all(s["one_sided"] == 0 for s in served[1:])
    assert all(s["random"] > 0 for s in served)


@pytest.mark.distributed
def test_sharded_lookup_equals_unsharded_bf16():
    served = run_distributed(_lookup_worker, 2, "bfloat16")
    assert served[0]["one_sided"] > 0 and served[1]["one_sided"] == 0


# --- the whole tiny model ---------------------------------------------------------------------------------------------

SEED, GLOBAL_ROWS, SEQ_LEN = 0, 4, 32


def _model_config():
    base = load_config("v41_tiny")
    assert list(base.engram.layers) == [1, 4]
    return base


def _build(mesh=None):
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = model_pkg.build(_model_config())
    sharding = apply_engram_sharding(model, mesh) if mesh is not None else None
    model.to_empty(device="cpu")
    model.init_weights()
    return model, sharding


def _batch():
    gen = torch.Generator().manual_seed(100)
    ids = torch.randint(0, 4096, (GLOBAL_ROWS, SEQ_LEN + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def _loss(model, input_ids, labels):
    fwd = model(input_ids, outputs=True)
    logits, aux = fwd.logits, fwd.aux
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten()) + sum(aux.values())


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _single_run() -> dict:
    model, _ = _build()
    loss = _loss(model, *_batch())
    loss.backward()
    return {"loss": float(loss.detach()),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "tables": {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("engram.table")}}


def _model_worker(rank: int, world: int, ckpt_dir: str | None) -> dict:
    """One step of 2-rank data parallelism; the tables sharded over the ranks when ckpt_dir is given, replicated
    (gradients all-reduced like every other weight) otherwise."""
    meshes = build_mesh(ParallelDims(dp_replicate=world, dp_shard=1, tp=1, pp=1, ep=1, cp=1), "cpu")
    model, sharding = _build(meshes.dp_ep_cp if ckpt_dir else None)
    tables = engram_tables(model)
    assert len(tables) == (2 if ckpt_dir else 0) and all(isinstance(t, DTensor) for t in tables)
    input_ids, labels = _batch()
    rows = slice(rank * GLOBAL_ROWS // world, (rank + 1) * GLOBAL_ROWS // world)
    if sharding is not None:
        sharding.prefetch(input_ids[rows])  # issued ahead of the forward, consumed by layers 1 and 4
        assert all(len(r.pending) == 1 for r in sharding.readers.values())
    loss = _loss(model, input_ids[rows], labels[rows])
    assert sharding is None or all(not r.pending for r in sharding.readers.values())
    loss.backward()
    # Replicated gradients averaged over the ranks; a sharded table's block already holds every rank's
    # contribution and is only divided.
    table_ids = {id(t) for t in tables}
    for p in model.parameters():
        if p.grad is not None and id(p) not in table_ids:
            dist.all_reduce(p.grad)
            p.grad /= world
    reduce_engram_gradients(model, world)
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    grads = {n: _full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
    if ckpt_dir:
        dcp.save(model.state_dict(), checkpoint_id=ckpt_dir)
    return {"loss": float(mean_loss) / world, "grads": grads} if rank == 0 else {}


def _model_workers(rank: int, world: int, ckpt_dir: str) -> tuple[dict, dict]:
    """`_model_worker` sharded (checkpoint in ckpt_dir), then replicated: one spawn for both (start-up dominates)."""
    return _model_worker(rank, world, ckpt_dir), _model_worker(rank, world, None)


@pytest.fixture(scope="module")
def single():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each spawned rank: GEMM reduction orders then differ only by the batch split
    try:
        return _single_run()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.distributed
def test_tiny_model_with_sharded_engram_matches_single_process(single, tmp_path):
    sharded, replicated = run_distributed(_model_workers, 2, str(tmp_path / "ckpt"))[0]
    assert sharded["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert sharded["grads"].keys() == single["grads"].keys() == replicated["grads"].keys()
    assert {n for n in single["grads"] if n.endswith("engram.table")} == {"layers.1.engram.table",
                                                                          "layers.4.engram.table"}
    # Against the single process on the whole batch: within 1e-5 of the gradient's norm, as a whole and tensor by
    # tensor. (A tensor's own norm is no scale here: the half-batch split alone, with replicated tables, moves
    # layer 4's Engram q/k weights by 3e-5 of theirs; the Engram gate's signed square root is steep near 0.)
    names = list(single["grads"])
    ref = torch.cat([single["grads"][n].flatten() for n in names])
    got = torch.cat([sharded["grads"][n].flatten() for n in names])
    assert (got - ref).norm() <= 1e-5 * ref.norm()
    for name in names:
        assert (sharded["grads"][name] - single["grads"][name]).norm() <= 1e-5 * ref.norm(), name
    # Against plain data parallelism with replicated tables, the same split: bit for bit. The owner adds the two
    # ranks' row sums (0 + g_0) + g_1, the all-reduce g_0 + g_1; everything else is the same computation.
    assert sharded["loss"] == replicated["loss"]
    for name in names:
        assert torch.equal(sharded["grads"][name], replicated["grads"][name]), name
    # The sharded checkpoint loads into the unsharded model with the single process's tables.
    model, _ = _build()
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    model.load_state_dict(state)
    for name, table in single["tables"].items():
        assert torch.equal(model.get_parameter(name), table), name


# --- composed with tensor parallelism ----------------------------------------------------------------------------------

def _tp_worker(rank: int, world: int, shard: bool) -> dict:
    from torch.distributed.tensor.parallel import loss_parallel

    from trainer.config import ParallelConfig
    from trainer.parallel.apply import parallelize

    parallel = ParallelConfig(tp=2, dp_replicate=world // 2)
    dims = parallel.resolve(world)
    meshes = build_mesh(dims, "cpu")
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = model_pkg.build(_model_config())
    pm = parallelize(model, meshes, parallel, dims, cuts=[])  # TP: Engram runs replicated, in DTensor form
    if shard:
        apply_engram_sharding(pm.module, meshes.dp_ep_cp)
    model.to_empty(device="cpu")
    model.init_weights()
    input_ids, labels = _batch()
    data_rank, data_size = meshes.data.get_local_rank(), meshes.data.size()
    rows = slice(data_rank * GLOBAL_ROWS // data_size, (data_rank + 1) * GLOBAL_ROWS // data_size)
    logits = model(input_ids[rows])  # vocabulary-sharded logits (loss_parallel)
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), labels[rows].flatten())
        loss.backward()
    tables = {n: p for n, p in model.named_parameters() if n.endswith("engram.table")}
    if shard:
        reduce_engram_gradients(model, data_size)
    else:  # replicated over tp and dp: average over the data ranks like any replicated weight
        for p in tables.values():
            g = p.grad.to_local()
            dist.all_reduce(g, group=meshes.data.get_group())
            g /= data_size
    mean_loss = _full(loss.detach()).clone()  # a replicated DTensor under loss_parallel
    dist.all_reduce(mean_loss, group=meshes.data.get_group())
    return {"loss": float(mean_loss) / data_size, "tables": {n: _full(p.grad).clone() for n, p in tables.items()}}


def _tp_workers(rank: int, world: int) -> tuple[dict, dict]:
    """`_tp_worker` with sharded, then replicated tables: one spawn for both (start-up dominates)."""
    return _tp_worker(rank, world, True), _tp_worker(rank, world, False)


@pytest.mark.distributed
def test_sharded_engram_under_tensor_parallelism():
    """tp 2 x dp 2, tables sharded over the 2 data ranks of each tp rank: the LM loss equals the single process's on
    the whole batch, and on every tp rank both tables' gradients equal bit for bit those of the same tp 2 x dp 2 run
    with replicated tables (whose all-reduce adds the same two terms)."""
    input_ids, labels = _batch()
    model, _ = _build()
    loss = float(F.cross_entropy(model(input_ids).flatten(0, 1), labels.flatten()))
    sharded, replicated = zip(*run_distributed(_tp_workers, 4))
    for got, want in zip(sharded, replicated):
        assert got["loss"] == pytest.approx(loss, rel=1e-5) and got["loss"] == want["loss"]
        assert got["tables"].keys() == want["tables"].keys() and len(got["tables"]) == 2
        for name, g in want["tables"].items():
            assert g.abs().sum() > 0 and torch.equal(got["tables"][name], g), name
