"""optim.clip_in_step: the gradient clip folded into the fused AdamW step (torch's grad_scale) is the same update as
the clip's multiply before the step, to fp32 rounding, over several steps with the clip active and inactive; the
builder turns it on only where it may (auto: a GPU run; on: refused for foreach, Muon and mixed devices)."""

import pytest
import torch

from optim import OptimConfig, build_optimizer
from trainer.parallel.apply import ParallelModel
from trainer.parallel.gradients import clip_grad_norm_


def _run(fold: bool, max_norm: float, steps: int = 4) -> tuple[list[torch.Tensor], list[float]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    opt = build_optimizer(model.parameters(), OptimConfig(lr=1e-2, clip_in_step="on" if fold else "off"))
    assert opt.clip_in_step is fold
    params, pm, norms = list(model.parameters()), ParallelModel.local(model), []
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(64, 16, generator=gen)
        model(x).square().mean().backward()
        norms.append(float(clip_grad_norm_(params, max_norm, pm, opt if fold else None)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in params], norms


@pytest.mark.parametrize("max_norm", [0.05, float("inf")])
def test_folded_clip_equals_multiply(max_norm):
    folded, folded_norms = _run(True, max_norm)
    plain, plain_norms = _run(False, max_norm)
    if max_norm < 1:
        assert min(plain_norms) > max_norm  # the clip is active at every step
    assert folded_norms == pytest.approx(plain_norms, rel=1e-5)
    for a, b in zip(folded, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_folded_scale_is_one_shot():
    """A scale handed to one step is not applied again by the next."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = build_optimizer([p], OptimConfig(lr=0.1, weight_decay=0.0, clip_in_step="on"))
    p.grad = torch.full((4,), 2.0)
    opt.scale_next_step(torch.tensor(0.5))
    opt.step()
    assert opt.grad_scale is None and opt._next_scale is None
    torch.testing.assert_close(p.grad, torch.full((4,), 1.0))  # left scaled, as a multiply before the step leaves it


def test_builder_resolves_and_refuses():
    p = torch.nn.Parameter(torch.ones(4, 4))
    assert build_optimizer([p], OptimConfig()).clip_in_step is False  # auto on CPU: the multiply (reference curve)
    with pytest.raises(ValueError, match="clip_in_step=on folds the clip into the fused AdamW step"):
        OptimConfig(clip_in_step="on", impl="foreach")
    with pytest.raises(ValueError, match="optim.clip_in_step must be one of"):
        OptimConfig(clip_in_step="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU half: auto resolves on for CUDA parameters")
def test_auto_folds_on_gpu():
    p = torch.nn.Parameter(torch.ones(4, 4, device="cuda"))
    q = torch.nn.Parameter(torch.ones(4, 4, device="cuda"))
    a, b = build_optimizer([p], OptimConfig(lr=0.1)), build_optimizer([q], OptimConfig(lr=0.1, clip_in_step="off"))
    assert a.clip_in_step is True and b.clip_in_step is False
    g = torch.randn(4, 4, device="cuda")
    p.grad, q.grad = g.clone(), g * 0.25
    a.scale_next_step(torch.tensor(0.25, device="cuda"))
    a.step()
    b.step()
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
