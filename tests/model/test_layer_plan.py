"""The layer plan: the flagship's roles and sources match SPEC 1.2 / REFERENCE A5 exactly, and every impossible plan
fails at config time with a ValueError naming the layer and the rule."""

import dataclasses

import pytest
from omegaconf import OmegaConf

from model.config import ModelConfig
from model.layer_plan import build_layer_plan


def load(name: str) -> ModelConfig:
    y = OmegaConf.load(f"conf/model/{name}.yaml")
    y.pop("defaults")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), y))


def test_flagship_plan_matches_spec():
    plan = build_layer_plan(load("v41_flash"))
    roles = {s.index: s.role for s in plan}
    assert [i for i, r in roles.items() if r == "swa"] == [0, 1]
    assert [i for i, r in roles.items() if r == "full"] == [2, 8, 14, 20]
    assert [i for i, r in roles.items() if r == "reindex"] == [24, 28, 32, 36]
    assert all(plan[i].role == "reuse" for i in range(40) if i not in (0, 1, 2, 8, 14, 20, 24, 28, 32, 36))
    assert [s.ratio for s in plan] == [0, 0] + [2] * 18 + [1] * 20
    for s in plan[3:8]:
        assert s.kv_source == 2 and s.index_source == 2
    for s in plan[21:40]:
        assert s.kv_source == 20
    assert plan[25].index_source == 24 and plan[39].index_source == 36 and plan[23].index_source == 20
    assert plan[20].builds_pool and plan[20].kv_input == "h_mid" and plan[2].kv_input == "self"
    assert [s.index for s in plan if s.uses_pool] == [24, 28, 32, 36]
    assert [s.index for s in plan if s.engram] == [1, 14]
    assert [s.rope for s in plan[:3]] == ["main", "main", "compress"]
    # 2.5 entries per token: three ratio-2 sources + one ratio-1 source
    assert sum(1 / s.ratio for s in plan if s.owns_kv) == 2.5


def test_tiny_keeps_every_structural_feature():
    cfg = load("v41_tiny")
    plan = build_layer_plan(cfg)
    enc = plan[: cfg.num_encoder_layers]
    dec = plan[cfg.num_encoder_layers:]
    assert [s.role for s in enc[:2]] == ["swa", "swa"]
    assert sum(s.role == "full" for s in enc) >= 2 and any(s.role == "reuse" for s in enc)
    assert all(s.ratio == 2 for s in enc[2:])
    assert dec[0].role == "full" and dec[0].ratio == 1 and dec[0].builds_pool
    assert {s.role for s in dec[1:]} == {"reindex", "reuse"}
    pool = cfg.csa2.candidate_topk_blocks * cfg.csa2.candidate_block_size
    assert pool < 128  # smaller than the training sequence
    assert len(cfg.engram.layers) == 2 and cfg.moe.num_experts >= 8 and cfg.moe.num_shared_experts >= 1
    assert cfg.mhc.num_streams == 4


def _bad(**csa2):
    cfg = load("v41_tiny")
    return dataclasses.replace(cfg, csa2=dataclasses.replace(cfg.csa2, **csa2))


@pytest.mark.parametrize("change, words", [
    (dict(kv_source_layers=[4, 6], index_source_layers=[4, 6, 8, 10]), "layer 2: compressed layer has no KV source"),
    (dict(kv_source_layers=[2, 4], index_source_layers=[2, 4, 8, 10], candidate_source_layer=4),
     "layer 6: compress ratio 1 differs from its KV source layer 4"),
    (dict(kv_source_layers=[0, 2, 4, 6], index_source_layers=[0, 2, 4, 6, 8, 10]), "layer 0: csa2.kv_source_layers names an SWA-only layer"),
    (dict(index_source_layers=[4, 6, 8, 10]), "layer 2: a KV source (Full layer) must also be an index source"),
    (dict(index_topk=64), "layer 6: index_topk=64 exceeds the candidate pool"),
    (dict(candidate_block_size=3), "layer 6: candidate_block_size=3 must be a power of two"),
    (dict(candidate_source_layer=8), "layer 8: csa2.candidate_source_layer must be a Full layer"),
    (dict(kv_source_layers=[2, 4, 6, 12], index_source_layers=[2, 4, 6, 12]), "layer 12: csa2.kv_source_layers names a layer outside"),
])
def test_impossible_plans_fail_with_named_rule(change, words):
    with pytest.raises(ValueError, match="layer plan: " + words.replace("(", r"\(").replace(")", r"\)")):
        build_layer_plan(_bad(**change))


def test_decoder_cannot_take_encoder_kv():
    cfg = load("v41_tiny")
    ratios = [0, 0, 2, 2, 2, 2] + [2] * 6
    bad = dataclasses.replace(cfg, csa2=dataclasses.replace(
        cfg.csa2, compress_ratios=ratios, kv_source_layers=[2, 4], index_source_layers=[2, 4],
        hierarchical_pool=False))
    with pytest.raises(ValueError, match="layer 6: decoder layer takes global KV from encoder layer 4"):
        build_layer_plan(bad)


def test_engram_out_of_range():
    cfg = load("v41_tiny")
    bad = dataclasses.replace(cfg, engram=dataclasses.replace(cfg.engram, layers=[1, 12]))
    with pytest.raises(ValueError, match="layer 12: engram.layers names a layer outside"):
        build_layer_plan(bad)


def test_bad_field_values_name_the_field():
    y = OmegaConf.load("conf/model/v41_tiny.yaml")
    y.pop("defaults")
    y.moe.experts_per_token = 99
    with pytest.raises(ValueError, match="model.moe.experts_per_token=99 exceeds num_experts=8"):
        OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), y))
