"""The optimiser builder: matrices are decayed, norms/biases/1-D parameters are not, frozen parameters are
left out, and non-fp32 trainable parameters are refused (parameters are the fp32 master copy)."""

import pytest
import torch

from optim import OptimConfig, build_optimizer, param_groups


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.proj = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.frozen = torch.nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def test_weight_decay_groups():
    model = _Toy()
    groups = param_groups(model.parameters(), weight_decay=0.1)
    decay, no_decay = groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model.emb.weight), id(model.proj.weight)}
    assert {id(p) for p in no_decay["params"]} == {
        id(model.proj.bias), id(model.norm.weight), id(model.norm.bias)
    }


def test_adamw_decays_only_matrices():
    model = _Toy()
    opt = build_optimizer(model.parameters(), OptimConfig(lr=0.1, weight_decay=0.5))
    assert isinstance(opt, torch.optim.AdamW)
    before_w, before_g = model.proj.weight.detach().clone(), model.norm.weight.detach().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    opt.step()  # zero gradients: only the decoupled decay moves parameters
    torch.testing.assert_close(model.proj.weight, before_w * (1 - 0.1 * 0.5))
    torch.testing.assert_close(model.norm.weight, before_g)


def test_rejects_low_precision_parameters():
    p = torch.nn.Parameter(torch.zeros(3, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="fp32"):
        build_optimizer([p], OptimConfig())


def _mixed_step(rank: int, world: int, impl: str) -> dict:
    """Plain tensors beside DTensors of two meshes; three AdamW steps with a multi-tensor step (optim.impl: fused, the
    default, or foreach), against torch's per-tensor AdamW on copies."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh_a = init_device_mesh("cpu", (world,), mesh_dim_names=("a",))
    mesh_b = init_device_mesh("cpu", (1, world), mesh_dim_names=("x", "b"))["b"]
    gen = torch.Generator().manual_seed(0)

    def params():
        g = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(4, 3, generator=g)),
                torch.nn.Parameter(distribute_tensor(torch.randn(6, 2, generator=g), mesh_a, [Shard(0)])),
                torch.nn.Parameter(distribute_tensor(torch.randn(5, generator=g), mesh_b, [Replicate()])),
                torch.nn.Parameter(torch.randn(7, generator=g))]

    ours, ref = params(), params()
    opt = build_optimizer(ours, OptimConfig(lr=1e-2, warmup_steps=0, impl=impl))
    torch_opt = torch.optim.AdamW(param_groups(ref, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    import optim.adamw as builder

    kinds_seen, kind = [], builder._kind
    builder._kind = lambda p: kinds_seen.append(p) or kind(p)  # counts how often the split is worked out
    for step in range(3):
        for o in (opt, torch_opt):  # a scheduler's lr change reaches the kept split's step
            for group in o.param_groups:
                group["lr"] = 1e-2 / (step + 1)
        grads = [torch.randn(p.shape, generator=gen) for p in ours]
        for mine, theirs, g in zip(ours, ref, grads):
            for p in (mine, theirs):
                p.grad = distribute_tensor(g, p.device_mesh, p.placements) if hasattr(p, "device_mesh") else g.clone()
        opt.step()
        torch_opt.step()
    builder._kind = kind
    raw = torch.optim.AdamW(params(), lr=1e-2, **{impl: True})
    for p in raw.param_groups[0]["params"]:
        p.grad = torch.zeros_like(p)
    try:
        raw.step()
        refused = ""
    except RuntimeError as e:  # what torch's own multi-tensor step does with such a list
        refused = str(e)
    full = lambda p: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()  # noqa: E731
    return {"ours": [full(p) for p in ours], "ref": [full(p) for p in ref], "refused": refused,
            "groups": [len(g["params"]) for g in opt.param_groups], "kinds_seen": len(kinds_seen)}


@pytest.mark.distributed
@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_multi_tensor_step_over_mixed_parameters(impl):
    """The builder's AdamW runs the multi-tensor step per kind of parameter (plain, DTensors by mesh), so layouts
    that mix them (tp, ep, Engram sharding) keep the fused or foreach step, which torch refuses for the mixed list;
    the updates equal torch's per-tensor AdamW (with the lr changing every step), and the param groups (what
    checkpoints hold) stay two. The split is worked out at the first step only: each parameter's kind once."""
    from tests.distributed import run_distributed

    (out,) = run_distributed(_mixed_step, 1, impl)
    assert "mixed torch.Tensor and DTensor" in out["refused"]
    assert out["groups"] == [2, 2]
    assert out["kinds_seen"] == 4  # four parameters, three steps: the kinds were read once
    for mine, ref in zip(out["ours"], out["ref"]):
        torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-7)


def test_impl_selects_torch_adamw_path():
    """optim.impl picks torch's AdamW implementation (auto = fused); every one makes the same update to rounding."""
    def run(impl):
        torch.manual_seed(0)
        m = _Toy()
        opt = build_optimizer(m.parameters(), OptimConfig(lr=1e-2, warmup_steps=0, impl=impl))
        for step in range(3):
            for p in m.parameters():
                p.grad = torch.full_like(p, 0.1 * (step + 1)) if p.requires_grad else None
            opt.step()
        return opt, [p.detach().clone() for p in m.parameters()]

    opt, want = run("for_loop")
    assert not any(g["fused"] or g["foreach"] for g in opt.param_groups)
    for impl in ("auto", "fused", "foreach"):
        opt, got = run(impl)
        assert all(g["fused"] == (impl in ("auto", "fused")) and g["foreach"] == (impl == "foreach")
                   for g in opt.param_groups), impl
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="optim.impl"):
        OptimConfig(impl="apex")
