"""Shared test helpers: load a model config from conf/model and build a small model the way the trainer does."""

import dataclasses
from pathlib import Path

import torch
from omegaconf import OmegaConf

import model as model_pkg
from model.config import ModelConfig
from optim.config import OptimConfig

ROOT = Path(__file__).resolve().parent.parent


def load_config(name: str, **overrides) -> ModelConfig:
    y = OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml")
    y.pop("defaults")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), y))
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def load_optim_config(name: str, **overrides) -> OptimConfig:
    """conf/optim/<name>.yaml as the trainer reads it, with `overrides` replaced."""
    y = OmegaConf.load(ROOT / "conf" / "optim" / f"{name}.yaml")
    y.pop("defaults")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(OptimConfig), y))
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def build_tiny(seed: int = 0, **overrides):
    """v41_tiny built on meta, materialised on CPU and initialised (fp32)."""
    cfg = load_config("v41_tiny", **overrides)
    torch.manual_seed(seed)
    with torch.device("meta"):
        m = model_pkg.build(cfg)
    m.to_empty(device="cpu")
    m.init_weights()
    return m


# The smallest model that still has every layer role, for the costliest whole-model tests: the Triton ones in
# tests/parallel (tp, cp, pp), where the CPU interpreter's cost grows with the layers and the tokens (one program per
# token in the attention, the mHC step and the top-k), and test_layouts.py's, where every layout's DTensor, FSDP and
# pipeline work grows with the layers. test_layouts.py and its followers run it on EVERY_ROLE_SEQ_LEN tokens, the Triton
# tests on TRITON_SEQ_LEN: the fewest at which everything below still holds (the window edge crossed, more entries than
# the top-k at ratio 2 (8 > 6) and than the pool at ratio 1 (16 > 12)) and cp 2 still splits them (chunks of 8: whole
# ratio-2 groups, a whole 7-row window halo, the window reaching into the other chunk); the interpreter then runs a
# third fewer programs than at 24.
EVERY_ROLE_SEQ_LEN = 24
TRITON_SEQ_LEN = 16


def every_role_config(**overrides) -> ModelConfig:
    """v41_tiny shrunk to 6 layers that keep every layer role the plan knows, and every branch the attention takes
    on it:

        0 SWA | 1 encoder Full (ratio 2) | 2 encoder Reuse | 3 decoder Full (ratio 1, KV from h_{L/2}, builds the
        candidate pool) | 4 decoder Reuse | 5 pool-restricted Reindex (its top-k published as entry ids), Engram

    and the same widths, heads, experts (8 + a shared one, 2 per token) and mHC streams. The window (8), the top-k (6)
    and the pool (3 blocks x 4 = 12 entries) shrink with the sequence, so that at EVERY_ROLE_SEQ_LEN = 24 tokens the
    window edge is crossed, the ratio-2 layers see more entries (12) than the top-k, and the ratio-1 layers more (24)
    than the pool holds (v41_tiny: window 32, top-k 16, pool 32 entries, for 48 to 128 tokens). 5 Sinkhorn iterations,
    as the trainer tests' micro model (tests/trainer/harness.py), not 20: the mHC kernel's backward recomputes the
    iterations, O(iters^2) steps a token, the interpreter's largest single cost at 20 (tests/kernels/test_mhc_triton.py
    runs 20; tests/model/test_kernels_switch.py 5 too)."""
    base = load_config("v41_tiny")
    cfg = dataclasses.replace(
        base,
        num_layers=6,
        num_encoder_layers=3,
        attention=dataclasses.replace(base.attention, window=8),
        csa2=dataclasses.replace(base.csa2, compress_ratios=[0, 2, 2, 1, 1, 1], kv_source_layers=[1, 3],
                                 index_source_layers=[1, 3, 5], candidate_source_layer=3, index_topk=6,
                                 candidate_block_size=4, candidate_topk_blocks=3),
        mhc=dataclasses.replace(base.mhc, sinkhorn_iters=5),
        engram=dataclasses.replace(base.engram, layers=[5]),
    )
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, what: str, floor: float = 0.0,
               rounding: torch.Tensor | None = None) -> None:
    """|actual - expected| <= 1e-5 * max(|expected|, floor * sqrt(numel)) in L2 over the tensor: a layout's tensor
    equals one process's to fp32 rounding. In norm, not element by element: the largest element's error sits in the
    tail of the rounding noise, which another reduction order (another CPU's SIMD path or BLAS blocking) moves past
    any fixed bound, while a real error (a missing term, a wrong element) moves the norm by far more. floor: an RMS
    below which rounding is not measured against the tensor's own size (sums that cancel). rounding: the same
    tensor after a one-ulp nudge of the weights: the distance twice that moves it is allowed too, where larger."""
    expected, actual = expected.double(), actual.double()
    bound = 1e-5 * max(expected.norm().item(), floor * expected.numel() ** 0.5)
    if rounding is not None:  # one draw of the nudge: twice its distance covers another draw's
        bound = max(bound, 2 * (rounding.double() - expected).norm().item())
    err = (actual - expected).norm().item()
    assert actual.shape == expected.shape and err <= bound, \
        f"{what}: |difference| {err:.3e} > {bound:.3e} (|expected| {expected.norm().item():.3e})"
