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
