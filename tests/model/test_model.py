"""The whole backbone on the tiny config: causality for every layer kind (at compression-group boundaries and window
edges, with and without FP4/FP8 fake-quant, in both indexer phases), Reuse layers own no KV or indexer weights,
Full/Reindex/Reuse layers read their sources from the right layers, the decoder's global KV comes from h_{L/2}, and
gradients reach every parameter that should learn and none that should not (the indexer learns only from its KL)."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import model.attention as attention_mod
from model import mhc
from tests.helpers import build_tiny

T = 72  # > window (32) and > pool (32 entries); not a multiple of the pool block


def _ids(seed=0, B=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 4096, (B, T), generator=g)


def _layer_outputs(m, ids):
    outs = {}
    hooks = [layer.attn.register_forward_hook(lambda mod, a, o, i=i: outs.__setitem__(i, o[0].detach()))
             for i, layer in enumerate(m.layers)]
    logits = m(ids)
    for h in hooks:
        h.remove()
    return logits, outs


@pytest.mark.parametrize("variant", ["plain", "quant", "dense_warmup", "no_pool"])
def test_causal_for_every_layer_kind(variant):
    from tests.helpers import load_config

    base = load_config("v41_tiny")
    over = {}
    if variant == "quant":
        over["quant"] = dataclasses.replace(base.quant, main_kv="fp4", index="fp4", swa_kv="fp8")
    if variant == "dense_warmup":
        over["indexer"] = dataclasses.replace(base.indexer, phase="dense_warmup")
    if variant == "no_pool":
        over["csa2"] = dataclasses.replace(base.csa2, hierarchical_pool=False)
    m = build_tiny(**over).eval()
    ids = _ids(B=1)
    ref_logits, ref = _layer_outputs(m, ids)
    W = base.attention.window
    # group boundaries for ratio 2 (even / odd positions), window edges, pool block edges, the last token
    for p in (1, 2, W, W + 1, 41, T - 1):
        changed = ids.clone()
        changed[:, p] = (changed[:, p] + 17) % 4093 + 3
        logits, outs = _layer_outputs(m, changed)
        torch.testing.assert_close(logits[:, :p], ref_logits[:, :p], rtol=0, atol=1e-5)
        for i in ref:
            torch.testing.assert_close(outs[i][:, :p], ref[i][:, :p], rtol=0, atol=1e-5,
                                       msg=f"layer {i} ({m.plan[i].role}) leaks position {p}")
        assert not torch.allclose(logits[:, p], ref_logits[:, p])  # the change itself is visible


def test_sequences_shorter_than_a_group(tiny):
    """1 to 3 tokens (no whole ratio-2 group at 1: no compressed entry yet, nothing published) give the logits of the
    same tokens at the start of a longer sequence."""
    ids = _ids(B=2)[:, :9]
    tiny.eval()
    with torch.no_grad():
        full = tiny(ids)
        for t in (1, 2, 3):
            torch.testing.assert_close(tiny(ids[:, :t]), full[:, :t], rtol=0, atol=1e-5)


def test_reuse_layers_own_no_kv_or_indexer(tiny):
    for layer in tiny.layers:
        names = {n for n, _ in layer.attn.named_parameters()}
        role = layer.spec.role
        has_comp = any(n.startswith("compressor.") for n in names)
        has_idx = any(n.startswith("indexer.") for n in names)
        has_keys = any(n.startswith("indexer.wk") or n.startswith("indexer.k_norm") for n in names)
        assert has_comp == (role == "full"), (layer.spec.index, role)
        assert has_idx == (role in ("full", "reindex")), (layer.spec.index, role)
        assert has_keys == (role == "full"), (layer.spec.index, role)
        assert {"wq_a.weight", "wkv.weight", "attn_sink"} <= names  # every layer keeps its own Q and SWA KV


def test_sources_come_from_the_right_layers(tiny, monkeypatch):
    calls = []
    real = attention_mod.attend

    def spy(q, kv_win, kv_cmp, win_mask, cmp_mask, sink):
        calls.append((None if kv_cmp is None else kv_cmp.data_ptr(),
                      None if cmp_mask is None else cmp_mask.data_ptr()))
        return real(q, kv_win, kv_cmp, win_mask, cmp_mask, sink)

    monkeypatch.setattr(attention_mod, "attend", spy)
    tiny(_ids())
    kv = [c[0] for c in calls]
    sel = [c[1] for c in calls]
    for spec in tiny.plan:
        i = spec.index
        if spec.role == "swa":
            assert kv[i] is None
            continue
        assert kv[i] == kv[spec.kv_source], f"layer {i} main KV"
        assert sel[i] == sel[spec.index_source], f"layer {i} top-k"
        if spec.role != "full":
            assert kv[i] == kv[spec.kv_source] and spec.kv_source != i
    # distinct sources really are distinct tensors
    assert len({kv[s.index] for s in tiny.plan if s.role == "full"}) == 3
    assert len({sel[s.index] for s in tiny.plan if s.role in ("full", "reindex")}) == 5


def test_decoder_kv_comes_from_h_mid(tiny):
    seen = {}
    dec_full = next(layer for layer in tiny.layers if layer.spec.is_decoder and layer.spec.role == "full")
    last_enc = tiny.layers[tiny.cfg.num_encoder_layers - 1]
    h1 = dec_full.attn.compressor.register_forward_pre_hook(lambda mod, args: seen.__setitem__("in", args[0]))
    h2 = last_enc.register_forward_hook(lambda mod, args, out: seen.__setitem__("enc", out))
    tiny(_ids())
    h1.remove(), h2.remove()
    S, pre, _ = seen["enc"]
    expect = dec_full.attn_norm(mhc.collapse(S, pre))
    torch.testing.assert_close(seen["in"], expect)


def _loss_parts(m, ids):
    fwd = m(ids, outputs=True)
    logits, aux = fwd.logits, fwd.aux
    lm = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return lm, aux


def _grads(m, loss):
    m.zero_grad(set_to_none=True)
    loss.backward(retain_graph=True)
    return {n: p.grad for n, p in m.named_parameters()}


def test_gradients_flow_where_they_should(tiny):
    ids = _ids()
    lm, aux = _loss_parts(tiny, ids)
    assert set(aux) >= {"indexer_kl"} and aux["indexer_kl"] > 0
    g_lm = _grads(tiny, lm)
    g_kl = _grads(tiny, aux["indexer_kl"])
    for name, p in tiny.named_parameters():
        is_indexer = ".attn.indexer." in name
        if not p.requires_grad:
            assert "gate.bias" in name, f"{name} unexpectedly frozen"  # MoE balancing biases move outside autograd
            continue
        if is_indexer:
            assert g_lm[name] is None or not g_lm[name].any(), f"LM loss reached indexer {name}"
            assert g_kl[name] is not None and g_kl[name].abs().sum() > 0, f"KL did not reach {name}"
        else:
            assert g_kl[name] is None or not g_kl[name].any(), f"indexer KL reached backbone {name}"
            if ".engram.table" in name:  # only looked-up rows get gradient; some must
                assert g_lm[name] is not None and g_lm[name].abs().sum() > 0
                continue
            assert g_lm[name] is not None and g_lm[name].abs().sum() > 0, f"no LM gradient to {name}"


def test_dense_warmup_trains_only_indexers():
    from tests.helpers import load_config

    base = load_config("v41_tiny")
    m = build_tiny(indexer=dataclasses.replace(base.indexer, phase="dense_warmup"))
    trainable = {id(p) for p in m.trainable_parameters()}
    names = [n for n, p in m.named_parameters() if id(p) in trainable]
    assert names and all(".attn.indexer." in n for n in names)
    _, aux = _loss_parts(m, _ids())
    assert aux["indexer_kl"] > 0


def test_meta_build_and_forward_shapes(tiny):
    logits = tiny(_ids(B=3))
    assert logits.shape == (3, T, 4096) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_outputs_carry_hidden_states_losses_and_the_forward_state(tiny):
    """outputs=True: the final hidden states are what the head reads, a chosen layer's hidden state is the streams
    collapsed as the next layer reads them (after the last encoder layer: h_{L/2}, which the state holds too), the
    state records every source's KV and top-k and every MoE layer's load, and the logits equal the plain call's."""
    ids = _ids()
    last_encoder = tiny.cfg.num_encoder_layers - 1
    with torch.no_grad():
        out = tiny(ids, outputs=True, hidden_layers=(0, last_encoder))
        plain = tiny(ids)
    assert torch.equal(out.logits, plain)
    assert torch.equal(tiny.head(out.hidden).float(), out.logits)
    assert out.hidden.shape == (2, T, tiny.cfg.dim)
    assert sorted(out.layer_hidden) == [0, last_encoder]
    assert torch.equal(out.layer_hidden[last_encoder], out.state.h_mid)
    state = out.state
    assert sorted(state.kv) == [s.index for s in tiny.plan if s.role == "full"]
    assert sorted(state.selection) == [s.index for s in tiny.plan if s.role in ("full", "reindex")]
    assert sorted(state.expert_load) == list(range(tiny.cfg.num_layers))
    assert all(int(load.sum()) == 2 * T * tiny.cfg.moe.experts_per_token for load in state.expert_load.values())
    assert set(out.aux) == {"indexer_kl"} and out.metrics["indexer_kl"] > 0


def test_the_kernel_switch_is_resolved_when_a_module_is_placed():
    """model.kernels is read once per module (kernels.KernelPath), not per call: a meta-built model takes the
    reference path, and materialising it re-resolves (triton here: the tests run the CPU interpreter)."""
    from model import kernels as kern
    from tests.helpers import load_config
    import model as model_pkg

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs the kernels on CPU
    cfg = load_config("v41_tiny", kernels="triton")
    with torch.device("meta"):
        m = model_pkg.build(cfg)
    switched = [mod for mod in m.modules() if isinstance(mod, kern.KernelPath)]
    assert len(switched) == 2 * cfg.num_layers + len(cfg.engram.layers)  # attention + block per layer, Engrams
    assert {mod.kernel_path for mod in switched} == {"reference"}
    m.to_empty(device=device)
    assert {mod.kernel_path for mod in switched} == {"triton"}
    auto = build_tiny(kernels="auto")  # on CPU
    assert {mod.kernel_path for mod in auto.modules() if isinstance(mod, kern.KernelPath)} == {"reference"}


def test_a_triton_model_built_where_triton_cannot_run_fails_at_its_forward(monkeypatch):
    """Building with kernels="triton" on the CPU without the interpreter is allowed (it may move to a GPU next); a
    forward there fails, naming the switch."""
    from model import kernels as kern

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    m = build_tiny(kernels="triton")  # on CPU
    with pytest.raises(RuntimeError, match="model.kernels='triton' needs CUDA tensors"):
        m(_ids(B=1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    m.float()  # re-placing the module resolves again
    assert {mod.kernel_path for mod in m.modules() if isinstance(mod, kern.KernelPath)} == {"triton"}
