"""Proves the model's kernel switch (`ModelConfig.kernels`, model/kernels.py).

Contract: the tiny model shrunk to 6 layers that keep every role with kernels="triton" equals kernels="reference" in
fp32 (logits, indexer KL, every parameter's gradient), in both indexer phases, with QAT and with FP4 main KV alone;
it goes through every Triton entry point the expected number of times and the reference through none; the fixed ids
are checked to sit on no discrete edge first (`Edges`), and under QAT a few codes may differ (`MAX_FLIPS`). Under
bf16 autocast the Triton run is as accurate as the bf16 reference. Context parallelism keeps every kernel on and
still equals the reference. "auto" is the reference on CPU and triton on CUDA; an unknown value is refused by the
config and by `resolve`; "triton" on CPU without the interpreter fails by name.

Design and reasoning: docs/testing.md#the-kernel-switch
"""

from __future__ import annotations

import collections
import dataclasses
import importlib

import pytest
import torch
import torch.nn.functional as F

import model.attention as attention_mod
from model import csa2
from model import kernels as kern
from model.forward import SequenceShard
from model.config import ModelConfig
from model.layer_plan import build_layer_plan
from tests.helpers import build_tiny, load_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 agreement, as a fraction of each tensor's largest magnitude: the interpreter's fp32 dots sum in another order
# than torch's; on the GPU the mHC kernel's projection is a bf16x3 split (~1e-5 relative) and atomics reorder sums.
FP32_TOL = 1e-4 if DEVICE == "cpu" else 2e-4

# Every Triton entry point the switch reaches: (module, function).
ENTRIES = {
    "fp4": ("kernels.fp4", "fake_quant"),
    "fp8": ("kernels.fp8", "fake_quant_fp8"),
    "norm_rope": ("kernels.norm_rope_fp4", "norm_rope_fake_quant"),
    "sparse_attention": ("kernels.sparse_attention", "sparse_attention"),
    "index_scores": ("kernels.indexer", "index_scores"),
    "candidate_pool": ("kernels.indexer", "candidate_pool"),
    "index_scores_pool": ("kernels.indexer", "index_scores_pool"),
    "select_topk": ("kernels.indexer", "select_topk"),
    "mhc": ("kernels.mhc_triton", "mhc_step"),
    "engram": ("kernels.engram_triton", "gate_update"),
}
# Entries without an `impl` argument (the mHC step, the Engram gate) are Triton only: their calls count as "triton".


# QAT settings by name: all three on, all off, and FP4 main KV alone (the others then run unquantised)
QUANT = {
    "qat": dict(main_kv="fp4", index="fp4", swa_kv="fp8"),
    "none": dict(main_kv="none", index="none", swa_kv="none"),
    "main_kv": dict(main_kv="fp4", index="none", swa_kv="none"),
}


def _overrides(phase: str = "sparse", qat: str = "qat", **extra) -> dict:
    base = load_config("v41_tiny")
    return dict(
        num_layers=6,
        num_encoder_layers=3,
        attention=dataclasses.replace(base.attention, window=8),  # window < T: its edge is exercised
        csa2=dataclasses.replace(
            base.csa2, compress_ratios=[0, 2, 2, 1, 1, 1], kv_source_layers=[1, 3], index_source_layers=[1, 3, 4],
            candidate_source_layer=3, index_topk=6, candidate_block_size=4, candidate_topk_blocks=3,
            # v41_tiny has 4: then ~1 score in 16 is exactly 0 (every head's ReLU 0), ties the top-k breaks by layout
            index_num_heads=8),
        indexer=dataclasses.replace(base.indexer, phase=phase),
        engram=dataclasses.replace(base.engram, layers=[2]),
        # 5 Sinkhorn iterations, not v41_tiny's 20, as tests/helpers.py's every_role_config: under the interpreter the
        # mHC coefficient kernel's backward (which recomputes the iterations, O(iters^2) steps a token) took a quarter
        # to a third of a Triton step at 20; the kernel at 20 is tests/kernels/test_mhc_triton.py's
        mhc=dataclasses.replace(base.mhc, sinkhorn_iters=5),
        quant=dataclasses.replace(base.quant, **QUANT[qat]),
        **extra,
    )


def _pair(phase: str, qat: str = "qat"):
    """The same weights twice: kernels="reference" and kernels="triton", on DEVICE."""
    ref = build_tiny(seed=0, **_overrides(phase, qat, kernels="reference")).to(DEVICE)
    tri = build_tiny(seed=0, **_overrides(phase, qat, kernels="triton")).to(DEVICE)
    tri.load_state_dict(ref.state_dict())
    return ref, tri


def _ids(B: int, T: int, seed: int = 4) -> torch.Tensor:
    return torch.randint(3, 4096, (B, T), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _step(m, ids, autocast: bool = False) -> dict[str, torch.Tensor]:
    """Forward + backward of LM loss + indexer KL; returns logits, the KL and every parameter's gradient."""
    m.zero_grad(set_to_none=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        fwd = m(ids, outputs=True)
        logits, aux = fwd.logits, fwd.aux
        loss = F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, dims=1).flatten()) + aux["indexer_kl"]
    loss.backward()
    out = {"logits": logits.detach().float(), "indexer_kl": aux["indexer_kl"].detach().float()}
    for name, p in m.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        out[name] = p.grad.detach().float()
    return out


class Launches:
    """Spies on every Triton entry point: calls counted by (entry, impl),
    and the fake-quant outputs of either path in call order (the stand-alone fake-quants' and the fused norm +
    RoPE + fake-quant's, whose site order is the same)."""

    def __init__(self, monkeypatch):
        self.calls: collections.Counter = collections.Counter()
        self.quantised: list[torch.Tensor] = []
        self.replay: list[torch.Tensor] | None = None
        """the other path's fake-quant outputs: with it set, each site returns the replayed values (keeping its own
        straight-through gradient), so a code flipped by fp32 noise on a rounding edge does not move later sites"""
        for entry, (module_name, fn) in ENTRIES.items():
            module = importlib.import_module(module_name)
            monkeypatch.setattr(module, fn, self._spy(entry, getattr(module, fn)))

    def _spy(self, entry, real):
        def spy(*args, **kwargs):
            self.calls[(entry, kwargs.get("impl", "triton"))] += 1
            out = real(*args, **kwargs)
            if entry in ("fp4", "fp8") or (entry == "norm_rope" and kwargs["quant"] is not None):
                q = out[0] if isinstance(out, tuple) else out
                self.quantised.append(q.detach().clone())
                if self.replay is not None:
                    q = q + (self.replay[len(self.quantised) - 1] - q).detach()
                    out = (q, *out[1:]) if isinstance(out, tuple) else q
            return out

        return spy

    def clear(self) -> None:
        self.calls.clear()
        self.quantised = []
        self.replay = None

    def kernel_calls(self) -> list:
        return [k for k in self.calls if k[1] != "reference"]


@pytest.fixture
def launches(monkeypatch):
    return Launches(monkeypatch)


def _expected_launches(plan, phase: str, quant: dict) -> collections.Counter:
    """One call per site of the plan, all with impl="triton"."""
    full = [s for s in plan if s.role == "full"]
    sources = [s for s in plan if s.owns_indexer]
    compressed = [s for s in plan if s.ratio > 0]
    n = collections.Counter({
        # fused: SWA KV (every layer), main KV and index keys (Full layers): norm + RoPE (+ fake-quant with QAT);
        # index queries (sources): RoPE + FP4, or plain RoPE without QAT (nothing to fuse)
        "norm_rope": len(plan) + 2 * len(full) + (len(sources) if quant["index"] == "fp4" else 0),
        "sparse_attention": len(plan) - (len(compressed) if phase == "dense_warmup" else 0),
        "index_scores": sum(not s.uses_pool for s in sources),
        "candidate_pool": sum(s.builds_pool for s in plan),
        "index_scores_pool": sum(s.uses_pool for s in plan),
        "select_topk": len(sources),
        "mhc": len(plan),  # one single-pass step per block (attention expand + FFN site)
        "engram": sum(s.engram for s in plan),
    })
    return +collections.Counter({(k, "triton"): v for k, v in n.items()})


class Edges:
    """How far the reference run stays from the model's edges, recorded from its own calls:
    - top-k and the pool (`model.csa2.select_topk`): the gap between the last pick and the first entry left out,
      relative to the row's largest score (0: a tie, which the two paths may break differently);
    - the Engram gate sigmoid(sign(s) sqrt(|s|)): min |s| = min logit(g)^2; its derivative 1 / (2 sqrt |s|) (the
      clamp at 1e-6 makes it 0 below) moves by a large fraction under a rounding change of s near 0."""

    def __init__(self, m, monkeypatch):
        self.topk_gaps: list[float] = []
        self.gates: list[torch.Tensor] = []
        real_topk = csa2.select_topk

        def topk(scores, k):
            kk = min(k, scores.shape[-1])
            if kk < scores.shape[-1]:
                top = scores.topk(kk + 1, dim=-1).values  # descending
                last, out = top[..., kk - 1], top[..., kk]
                both = torch.isfinite(last) & torch.isfinite(out)
                scale = scores.masked_fill(~torch.isfinite(scores), 0).abs().amax(-1).clamp_min(1e-30)
                if both.any():
                    self.topk_gaps.append(((last - out) / scale)[both].min().item())
            return real_topk(scores, k)

        monkeypatch.setattr(csa2, "select_topk", topk)  # candidate_pool's blocks
        monkeypatch.setattr(attention_mod, "select_topk", topk)  # the top-k
        for layer in m.layers:
            if layer.engram is not None:
                real = layer.engram.gate
                monkeypatch.setattr(layer.engram, "gate", lambda *a, _real=real: self.gates.append(_real(*a)) or
                                    self.gates[-1])

    def check(self) -> None:
        assert self.topk_gaps and self.gates, "the reference run did not go through the recorded sites"
        gap = min(self.topk_gaps)
        assert gap > 1e-5, f"a top-k or pool pick is (nearly) tied, relative gap {gap:.1e}: pick other ids"
        margin = min(torch.logit(g.double()).square().min().item() for g in self.gates)
        assert margin > 1e-3, f"a token sits near the Engram gate's singularity, |s| = {margin:.1e}: pick other ids"


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """max |actual - expected| <= tol * max |expected|."""
    assert torch.isfinite(actual).all() and torch.isfinite(expected).all(), what
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= tol * scale, f"{what}: max error {err:.3e} > {tol:g} x max |ref| {scale:.3e}"


def test_shrunk_plan_keeps_every_role():
    plan = build_layer_plan(dataclasses.replace(load_config("v41_tiny"), **_overrides()))
    assert [s.role for s in plan] == ["swa", "full", "reuse", "full", "reindex", "reuse"]
    assert [s.ratio for s in plan] == [0, 2, 2, 1, 1, 1]
    assert plan[2].engram and plan[3].is_decoder and plan[3].kv_input == "h_mid"
    assert plan[3].builds_pool and plan[4].uses_pool


# (phase, QAT settings, ids seed: ids whose reference run sits on no edge, see `Edges`). On a GPU (minutes, not the
# interpreter's) also without QAT: its rounding edges move with the GPU's summation order, so that case stays
# conclusive if a QAT case meets one there. Seed 3 on CPU since the model runs 5 Sinkhorn iterations: with 4, an FP4
# code of the QAT cases sits on a rounding edge (flipped by fp32 noise, then later sites follow); of the seeds 0 to 7
# only 0, 1 and 3 sit on no edge there, and 3 keeps the widest margins in all three cases (top-k gap >= 7.6e-4 of the
# row's largest score, Engram |s| >= 1.3e-2; `Edges` asks for 1e-5 and 1e-3).
MAX_FLIPS = 4
"""fake-quantised values the two paths may round to different codes in one run. Both paths quantise bit for bit
alike (tests/kernels' FP4/FP8 tests), but their inputs differ by fp32 rounding (sums in another order), so a value
within ~1e-7 of a rounding midpoint may go either way; which values sit there depends on the CPU's own rounding
(seed 3's dense warm-up case flips 2 of its 44k values on one CPU, none on another). The triton run replays the
reference's codes at every site (`Launches.replay`), so one flip does not spread to later sites, and the comparison
stays as tight as without QAT; a quantiser bug flips far more than a handful."""

CASES = [("sparse", "qat", 3), ("dense_warmup", "qat", 3), ("sparse", "main_kv", 3)] + (
    [("sparse", "none", 4)] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("phase, qat, seed", CASES)
def test_triton_equals_reference_fp32(phase, qat, seed, launches, monkeypatch):
    B, T = 2, 17  # T: a partial m=2 group, a partial pool block (17 = 4 * 4 + 1), and T > window
    ref, tri = _pair(phase, qat)
    ids = _ids(B, T, seed)
    edges = Edges(ref, monkeypatch)
    want = _step(ref, ids)
    edges.check()
    assert not launches.kernel_calls(), f"the reference run launched kernels: {launches.calls}"
    ref_quantised = launches.quantised
    launches.clear()
    launches.replay = ref_quantised  # each site continues from the reference's codes (see MAX_FLIPS)
    got = _step(tri, ids)
    assert launches.calls == _expected_launches(tri.plan, phase, QUANT[qat])
    assert len(launches.quantised) == len(ref_quantised)
    flipped = {i: int((a != b).sum()) for i, (a, b) in enumerate(zip(launches.quantised, ref_quantised))}
    flipped = {i: n for i, n in flipped.items() if n}
    total = sum(q.numel() for q in ref_quantised)
    print(f"{phase}, QAT {qat}: {sum(flipped.values())} of {total} fake-quantised values flipped, by site {flipped}")
    assert sum(flipped.values()) <= MAX_FLIPS, (
        f"QAT rounded differently at {flipped} (site: values): more than rounding edges explain")
    assert want["indexer_kl"] > 0  # the KL is live: its gradient reaches the indexers
    worst = max(((got[k] - want[k]).abs().max() / want[k].abs().max()).item() for k in want)
    print(f"{phase}, QAT {qat}: worst error {worst:.1e} of a tensor's largest magnitude ({len(want)} tensors)")
    for key in want:
        _assert_close(got[key], want[key], FP32_TOL, f"{phase}: {key}")


def test_bf16_autocast_is_as_accurate_as_the_reference():
    ref, tri = _pair("sparse")
    ids = _ids(1, 16)
    truth = _step(ref, ids)
    r16 = _step(ref, ids, autocast=True)
    t16 = _step(tri, ids, autocast=True)
    params = [k for k in truth if k not in ("logits", "indexer_kl")]
    report = []
    for what, keys, floor in (("logits", ["logits"], 0.02), ("indexer_kl", ["indexer_kl"], 0.1),
                              ("all gradients", params, 0.02)):
        def flat(d):
            return torch.cat([d[k].flatten() for k in keys])

        norm = flat(truth).norm().item()
        e_ref = (flat(r16) - flat(truth)).norm().item() / norm
        e_tri = (flat(t16) - flat(truth)).norm().item() / norm
        report.append(f"{what}: bf16 reference {e_ref:.2e}, bf16 triton {e_tri:.2e} (relative to fp32)")
        assert e_tri <= 1.5 * e_ref + floor, "; ".join(report)
    print("\n".join(report))


def test_context_parallelism_takes_the_kernels(launches):
    ref, tri = _pair("sparse", qat="none")
    # any installed shard means context parallelism to the attention (here one chunk with identity hooks); the
    # exchanges themselves are proven in tests/parallel/test_cp.py (Triton under cp 2)
    tri.sequence_shard = SequenceShard(chunk_mean=lambda t: t)
    ids = _ids(1, 12)
    with torch.no_grad():
        want = ref(ids)
        launches.clear()
        got = tri(ids)
    for entry in ("sparse_attention", "index_scores", "candidate_pool", "index_scores_pool"):
        assert launches.calls[(entry, "triton")], (entry, launches.calls)
    assert launches.calls[("mhc", "triton")] and launches.calls[("engram", "triton")]
    _assert_close(got, want, FP32_TOL, "logits")


def test_auto_is_reference_on_cpu_and_triton_on_cuda(launches):
    assert kern.resolve("auto", "cpu") == "reference"
    assert kern.resolve("auto", torch.device("cuda", 0)) == "triton"
    assert kern.resolve("auto", "meta") == kern.resolve("triton", "meta") == "reference"
    assert kern.resolve("reference", "cuda") == "reference"
    m = build_tiny(**_overrides(kernels="auto"))  # on CPU
    with torch.no_grad():
        m(_ids(1, 12).cpu())
    assert launches.calls and not launches.kernel_calls(), launches.calls


def test_unknown_kernels_value_is_rejected(monkeypatch):
    with pytest.raises(ValueError, match="model.kernels"):
        ModelConfig(kernels="cuda")
    with pytest.raises(ValueError, match="model.kernels"):
        kern.resolve("fast", "cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kern.resolve("triton", "cpu")
