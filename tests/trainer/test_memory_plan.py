"""The planner: `python -m trainer.cli.plan model=v41_flash` prints the flagship's figures read off the meta-built model,
within the report's tolerances (backbone 552B +-1%, Engram 196B +-1%, decode-active 16B +-5%, prefill-active 8B
+-10%, global KV exactly 890 B/token and all of it persistent); a bad override fails with a clear message.

The trainer's start-up checks come first: a layout the trainer refuses (tp not dividing the heads, too few
micro-batches for the pipeline, cp not dividing the sequence, sizes that do not make --world-size) exits 2 with one
`error: ...` line, the very message of the trainer's own functions (validate_layout, ParallelConfig.resolve), and is
never planned; a mistyped config group option is one line naming the group and its options.

The training plan (per rank memory and communication):

The rest of what it proves: docs/testing.md#the-memory-planner
"""

import json
import math
import os

import pytest
import torch

from tests.fork_server import run_module
from tests.helpers import ROOT, load_config
from trainer.memory_plan import Layout, param_kind, plan_model, stage_parameters


def _run(*args):
    return run_module("trainer.cli.plan", ["--json", *args], cwd=ROOT, env=dict(os.environ), timeout=120)


def test_flagship_figures_from_cli():
    r = _run("model=v41_flash")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert abs(out["params_backbone"] / 552e9 - 1) < 0.01
    assert abs(out["params_engram"] / 196e9 - 1) < 0.01
    assert abs(out["params_active_decode"] / 16e9 - 1) < 0.05
    assert abs(out["params_active_prefill"] / 8e9 - 1) < 0.10
    assert out["kv_bytes_per_token"] == 890
    assert out["kv_bytes_per_token_persistent"] == out["kv_bytes_per_token"]
    assert out["swa_kv_bytes_per_layer"] == 128 * 528  # one FP8 window: 512 e4m3 values + 16 ue8m0 scales
    assert out["params_total"] == out["params_backbone"] + out["params_engram"]
    assert out["decode_flops_per_token_1m"] > out["decode_flops_per_token_4k"] > 2 * out["params_active_decode"]
    for key in ("params_total", "params_backbone", "params_engram", "params_active_prefill", "params_active_decode",
                "kv_bytes_per_token", "kv_bytes_per_token_persistent", "swa_kv_bytes_per_layer",
                "decode_flops_per_token_4k", "decode_flops_per_token_1m"):
        assert key in out


def test_the_default_output_is_a_table(capsys):
    """Without --json: the counts, the layout, each term's GiB per pipeline rank, the peak, fits or not, the dominant
    term; no JSON."""
    from trainer.cli.plan import main

    main(["model=v41_tiny", "+parallel.device_memory_gb=1"])
    out = capsys.readouterr().out
    assert not out.lstrip().startswith("{")
    lines = out.splitlines()
    assert lines[0].startswith("model v41_tiny: 7.25M parameters (backbone 6.47M, Engram 785.98K)")
    assert lines[4].split() == ["memory", "per", "GPU,", "GiB", "pp", "rank", "0"]
    terms = {" ".join(ln.split()[:-1]): ln.split()[-1] for ln in lines[5:13]}
    assert list(terms) == ["parameters", "gradients", "optimizer state", "activations", "working set",
                           "optimizer step", "reserve", "peak"]
    assert abs(sum(float(v) for k, v in terms.items() if k != "peak") - float(terms["peak"])) < 0.05
    assert lines[13].split()[:2] == ["dominant", "term"]
    assert any(ln.startswith("does NOT fit: peak") and "of 0.93 GiB per device" in ln for ln in lines)
    # the option it names works when pasted (the key is the planner's own: with a +)
    assert any("(another: +parallel.device_memory_gb=<GB>)" in ln for ln in lines)


def test_counts_follow_the_modules():
    """Changing the config changes the figures through the modules, not through a separate formula."""
    cfg = load_config("v41_flash")
    base = plan_model(cfg)
    import dataclasses

    fewer = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, num_experts=192))
    half = plan_model(fewer)
    per_expert = 3 * cfg.dim * cfg.moe.expert_dim * cfg.num_layers
    assert base["params_routed_experts"] - half["params_routed_experts"] == 192 * per_expert
    bf16 = dataclasses.replace(cfg, quant=dataclasses.replace(cfg.quant, cache_main_kv="bf16"))
    assert plan_model(bf16)["kv_bytes_per_token"] == 2.5 * (1024 + 68)


def test_bad_override_is_reported():
    r = _run("model=v41_flash", "model.moe.experts_per_token=999")
    assert r.returncode == 2
    assert "experts_per_token" in r.stderr


# --- the trainer's start-up checks -------------------------------------------------------------------------------------


def _main(capsys, *args) -> tuple[int, str, str]:
    """`python -m trainer.cli.plan args` in this process: (exit status, stdout, stderr)."""
    from trainer.cli.plan import main

    code = 0
    try:
        main(["--json", *args])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _trainer_refusal(world_size: int, *overrides: str) -> str:
    """What the trainer's build (trainer/train.py) raises for these overrides, from its own functions."""
    from trainer.config import to_config
    from trainer.parallel.apply import validate_layout
    from trainer.compose import compose

    cfg = to_config(compose(["model=v41_tiny", *overrides]))
    with pytest.raises(ValueError) as e:
        validate_layout(cfg.parallel, cfg.model, seq_len=cfg.data.seq_len, grad_accum=cfg.trainer.grad_accum)
        cfg.parallel.resolve(world_size)
    return str(e.value)


@pytest.mark.parametrize("overrides", [
    ("parallel.tp=3",),  # does not divide the 4 query heads
    ("parallel.pp=2",),  # 1F1B over 2 stages with trainer.grad_accum=1
    ("parallel.cp=3",),  # does not divide data.seq_len
    ("parallel.ep=3",),  # does not divide the routed experts
    ("--world-size=3", "parallel.tp=2"),  # 2 does not divide 3 processes
], ids=["tp", "pp", "cp", "ep", "world_size"])
def test_layout_the_trainer_refuses_is_not_planned(capsys, overrides):
    world = next((int(a.split("=")[1]) for a in overrides if a.startswith("--world-size=")), None)
    hydra_overrides = [a for a in overrides if not a.startswith("--")]
    code, out, err = _main(capsys, "model=v41_tiny", *overrides)
    assert code == 2 and out == "" and '"fits"' not in out
    assert err.count("\n") == 1 and "Traceback" not in err
    want = _trainer_refusal(world or math.prod(int(a.split("=")[1]) for a in hydra_overrides), *hydra_overrides)
    assert err == f"error: {want}\n"


def test_world_size_fills_dp_replicate(capsys):
    code, out, err = _main(capsys, "--world-size", "8", "model=v41_tiny", "parallel.tp=2")
    assert code == 0, err
    lay = json.loads(out)["training"]["layout"]
    assert (lay["world_size"], lay["dp_replicate"], lay["tp"]) == (8, 4, 2)
    code, out, err = _main(capsys, "model=v41_tiny")  # no world size: the sizes' own, noted in the assumptions
    assert code == 0, err
    training = json.loads(out)["training"]
    assert training["layout"]["world_size"] == 1 and any("--world-size" in a for a in training["assumptions"])


@pytest.mark.parametrize("override, group, options", [
    ("model=v41_tinny", "model", "v41_flash, v41_proxy, v41_small, v41_tiny, v41_tiny_mm"),
    ("parallel=nosuch", "parallel", "default, flagship_256xh200"),
])
def test_mistyped_config_group_is_one_line(capsys, override, group, options):
    code, out, err = _main(capsys, override)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: {override}: config group '{group}' has no option") and err.rstrip().endswith(
        f"options: {options}")


# --- the training plan ------------------------------------------------------------------------------------------------

FLAGSHIP = ("model=v41_flash", "parallel=flagship_256xh200", "data.seq_len=4096", "data.batch_size=1",
            "trainer.grad_accum=16")


def test_flagship_layout_fits_with_activation_checkpointing():
    r = _run(*FLAGSHIP)  # the layout sets parallel.activation_checkpoint=full
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)["training"]
    lay = plan["layout"]
    assert lay["world_size"] == 256 and (lay["pp"], lay["ep"], lay["tp"], lay["engram_group"]) == (4, 64, 1, 64)
    assert lay["activation_checkpoint"] == "full"
    assert plan["fits"] and plan["peak_bytes"] < 141e9
    assert plan["dominant"]["term"] == "routed_experts (params + grads + optimiser state)"
    ranks = plan["per_pp_rank"]
    assert len(ranks) == 4 and plan["peak_bytes"] == max(r["peak_bytes"] for r in ranks)
    for rank in ranks:
        static = sum(rank[k][kind] for k in ("params_bytes", "grads_bytes", "optimizer_bytes")
                     for kind in rank["params_bytes"])
        dynamic = max(rank["activations_bytes"] + rank["working_set_bytes"], rank["optimizer_step_transient_bytes"])
        assert rank["peak_bytes"] == pytest.approx(static + dynamic + rank["reserve_bytes"])
        # AdamW: 8 bytes of moments per element, 4 more for the master copy of the bf16 Engram rows.
        assert sum(rank["optimizer_bytes"].values()) == 8 * rank["params_numel"] + 4 * rank[
            "params_low_precision_numel"]
        comm = rank["communication_bytes_per_step"]
        assert comm["ep"] > 0 and comm["pp"] > 0 and comm["dp"] > 0 and comm["tp"] == comm["cp"] == 0
    # The Engram layers sit on the first two pipeline ranks, each table in 64 row blocks (bf16).
    rows_l14 = 384_016_682
    assert ranks[1]["params_bytes"]["engram_tables"] == -(-rows_l14 // 64) * 256 * 2
    assert ranks[2]["params_bytes"]["engram_tables"] == 0 and ranks[1]["communication_bytes_per_step"]["engram"] > 0


def test_flagship_layout_with_the_reports_optimisers():
    """optim=muon on the flagship layout: Muon and Sinkhorn parameters keep one fp32 buffer (AdamW two), so the peak
    falls below AdamW's 133 GB (the layout's conf file) even with a whole Engram table's rows touched at once; the
    layout splits no Muon block (experts whole per ep rank, dense weights replicated), so no owner gathers.
    v41_small under FSDP2 (dp_shard 2) has its dense matrices gathered by owners (2 x 4 B per local value), not its
    experts (FSDP's row shards hold whole experts)."""
    r_muon = _run(*FLAGSHIP, "optim=muon")
    assert r_muon.returncode == 0, r_muon.stderr
    muon = json.loads(r_muon.stdout)["training"]
    assert muon["fits"] and muon["peak_bytes"] < 125e9
    for rank in muon["per_pp_rank"]:
        m = rank["params_momentum_numel"]
        assert 0.99 * rank["params_numel"] < m < rank["params_numel"]  # all but the norms, gates, sinks and mHC
        assert sum(rank["optimizer_bytes"].values()) == (8 * (rank["params_numel"] - m) + 4 * m
                                                          + 4 * rank["params_low_precision_numel"])
        assert rank["communication_bytes_per_step"]["optimizer"] == 0
    r = _run("model=v41_small", "optim=muon", "parallel.dp_shard=2", "--world-size=2")
    assert r.returncode == 0, r.stderr
    (rank,) = json.loads(r.stdout)["training"]["per_pp_rank"]
    comm = rank["communication_bytes_per_step"]["optimizer"]
    assert 0 < comm < 2 * 4 * 0.25 * rank["params_momentum_numel"]


def test_flagship_layout_without_activation_checkpointing_does_not_fit():
    r = _run(*FLAGSHIP, "parallel.activation_checkpoint=none")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)["training"]
    assert not plan["fits"] and plan["dominant"]["term"] == "activations"


# The activation terms against what autograd saves (CPU runs the same code for these three pieces).

def _saved_bytes(fn, exclude) -> int:
    """Bytes of the distinct storages autograd saves during fn(), parameters excluded."""
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in exclude:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_activation_terms_match_saved_tensors():
    from model import accounting
    from tests.helpers import build_tiny

    model = build_tiny()
    cfg, layer = model.cfg, model.layers[1]
    assert layer.engram is not None
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    B, T = 2, 64
    est = accounting.layer_activation_bytes(layer, B * T, T)
    casts = {name: 2 * sum(p.numel() for p in mod.parameters() if p.ndim >= 2 and p is not layer.ffn.gate.weight)
             for name, mod in (("moe", layer.ffn), ("engram", layer.engram.wkv))}  # the router runs in fp32
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, cfg.dim, generator=gen, requires_grad=True)
    S = torch.randn(B, T, cfg.mhc.num_streams, cfg.dim, generator=gen, requires_grad=True)
    rows, dead = model.hasher.for_tokens(torch.randint(0, cfg.vocab_size, (B, T), generator=gen))[1]
    n_dim = cfg.mhc.num_streams * cfg.dim
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moe = _saved_bytes(lambda: layer.ffn(layer.ffn_norm(x)), params)
        engram = _saved_bytes(lambda: layer.engram(S, rows, dead), params)
        site = _saved_bytes(lambda: layer.hc_attn(S), params)
    assert moe == pytest.approx(est["moe"] + est["norms"] / 2 + casts["moe"], rel=0.02)
    assert engram == pytest.approx(est["engram"] + casts["engram"], rel=0.02)
    # one site: the streams and their normalised fp32 copy (2 of the per-token stream terms) and its coefficients
    assert site == pytest.approx(B * T * 8 * n_dim + (est["mhc_coefficients"] - B * T * 4 * 25) / 2, rel=0.02)


# What the planner and the accounting count as tp-split (trainer.parallel.tensor.tp_shard_dims) against apply_tp's DTensors.


def test_tp_shard_dims_are_apply_tps_placements():
    """apply_tp on a meta model moves no data (every rank keeps its own slice), so a tp mesh of 2 on torch's fake
    process group (one process, no peers) gives the placements 2 gloo ranks get, at a tenth of the cost of spawning
    them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import model as model_pkg
    from trainer.parallel.tensor import apply_tp, tp_shard_dims

    with torch.device("meta"):
        model = model_pkg.build(load_config("v41_tiny"))
    want = tp_shard_dims(model)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        apply_tp(model, init_device_mesh("cpu", (2,)), sequence_parallel=False)
    finally:
        dist.destroy_process_group()
    got = {name: next((pl.dim for pl in p.placements if isinstance(pl, Shard)), None) if isinstance(p, DTensor)
           else "plain" for name, p in model.named_parameters()}
    assert "plain" not in got.values()
    assert {name: d for name, d in got.items() if d is not None} == want
    # every kind of split is in there: column-wise, row-wise, embedding channels, expert width, custom placements
    assert (want["embed.weight"], want["head.weight"], want["layers.0.attn.wq_b.weight"]) == (1, 0, 0)
    assert (want["layers.0.attn.wo_b.weight"], want["layers.0.ffn.experts.w2"], want["layers.0.attn.attn_sink"]) == \
        (1, 2, 0)


# The planner's per-rank parameters against the real sharded tiny model (meta device, 4 gloo ranks).

LAYOUTS = {"tp2_ep2": dict(tp=2, ep=2), "pp2_ep2": dict(pp=2, ep=2), "fsdp2_ep2": dict(dp_shard=2, ep=2)}


def _local_numel(p) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def _sharded_worker(rank: int, world: int, sizes: dict) -> dict:
    from model import build
    from trainer.config import ParallelConfig
    from trainer.parallel.apply import parallelize
    from trainer.parallel.engram import apply_engram_sharding, engram_tables
    from trainer.parallel.mesh import build_mesh

    parallel = ParallelConfig(**sizes)
    dims = parallel.resolve(world)
    meshes = build_mesh(dims, "cpu")
    with torch.device("meta"):
        model = build(load_config("v41_tiny"))
    cuts = [6] if dims.pp > 1 else []
    pm = parallelize(model, meshes, parallel, dims, cuts=cuts)
    apply_engram_sharding(pm.module, meshes.dp_ep_cp)
    if dims.dp_shard > 1:
        from torch.distributed.fsdp import fully_shard

        layers = pm.module.layers
        for block in layers.values() if isinstance(layers, torch.nn.ModuleDict) else layers:
            fully_shard(block, mesh=meshes.dp_shard, ignored_params=set(engram_tables(block)))
        fully_shard(pm.module, mesh=meshes.dp_shard, ignored_params=set(engram_tables(pm.module)))
    out = {"pp_rank": meshes.pp.get_local_rank(), "group_rank": meshes.dp_ep_cp.get_local_rank(),
           "fsdp_rank": meshes.dp_shard.get_local_rank()}
    for name, p in pm.module.named_parameters():
        kind = param_kind(name)
        out[kind] = out.get(kind, 0) + _local_numel(p)
        out[kind + "_bytes"] = out.get(kind + "_bytes", 0) + _local_numel(p) * p.element_size()
    return out


def _sharded_workers(rank: int, world: int) -> dict:
    """`_sharded_worker` for every layout in one spawn (process start-up dominates); a failure is reported for its
    layout and stops the rest (the peers may be stuck in a collective of the failed one)."""
    import traceback

    out = {}
    for name, sizes in sorted(LAYOUTS.items()):
        try:
            out[name] = _sharded_worker(rank, world, sizes)
        except Exception:
            out[name] = traceback.format_exc()
            break
    return out


@pytest.fixture(scope="module")
def sharded_runs() -> dict:
    """layout name -> every rank's local parameter counts, all layouts from one spawn of 4 ranks."""
    from tests.distributed import run_distributed

    ranks = run_distributed(_sharded_workers, 4)
    return {name: [r.get(name, f"{name} did not run (an earlier layout failed)") for r in ranks] for name in LAYOUTS}


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_planned_parameters_equal_real_shards(name, sharded_runs):
    import model as model_pkg

    sizes = LAYOUTS[name]
    ranks = sharded_runs[name]
    for got in ranks:
        assert not isinstance(got, str), got
    with torch.device("meta"):
        meta = model_pkg.build(load_config("v41_tiny"))
    lay = Layout(**sizes, engram_shard=True)
    bounds = [0, 6, meta.cfg.num_layers] if lay.pp > 1 else [0, meta.cfg.num_layers]
    planned = stage_parameters(meta, lay, bounds)
    for got in ranks:
        want = planned[got["pp_rank"]]
        for kind, rec in want.items():
            # The planner states the largest share: Engram group rank 0's block, FSDP rank 0's (padded) chunks.
            if (got["group_rank"] if kind == "engram_tables" else got["fsdp_rank"]) != 0:
                assert got.get(kind, 0) <= rec["numel"], (name, got, kind)
                continue
            assert got.get(kind, 0) == rec["numel"], (name, got["pp_rank"], kind, got.get(kind, 0), rec["numel"])
            assert got.get(kind + "_bytes", 0) == rec["bytes"], (name, kind)
    assert any(got.get("engram_tables", 0) > 0 for got in ranks)
    if lay.pp > 1:
        assert {got["pp_rank"] for got in ranks if got.get("embed", 0)} == {0}
        assert {got["pp_rank"] for got in ranks if got.get("head", 0)} == {1}


def test_fused_loss_plans_no_logits():
    """trainer.fused_loss: the last stage keeps only the per-token log-sum-exp, and its working set one chunk's fp32
    logits and their gradient, where the plain loss keeps the [tokens, vocab] fp32 logits and log-softmax and works
    on their gradient (v41_small, one rank, 4 x 2048 tokens)."""
    from trainer.fused_loss import default_chunk_tokens
    from trainer.compose import compose
    from trainer.memory_plan import plan

    base = ["model=v41_small", "data.seq_len=2048", "data.batch_size=4"]
    plain, fused = (plan(compose(base + extra))["training"]["per_pp_rank"][0]
                    for extra in ([], ["trainer.fused_loss=true"]))
    tokens, vocab = 4 * 2048, 32768
    chunk = min(tokens, default_chunk_tokens(vocab))
    assert plain["activations_bytes"] - fused["activations_bytes"] == pytest.approx(8 * tokens * vocab - 4 * tokens)
    assert plain["working_set_bytes"] - fused["working_set_bytes"] == pytest.approx(
        4 * tokens * vocab - 8 * chunk * vocab)
