"""The Hugging Face format of DeepSeek-V4.1-Flash, both ways: parameter names, shapes and dtypes as the public
implementation (transformers' `deepseek_v41`, REFERENCE A11) keeps them, and its config keys (A1).

Contract: `hf_tensors(name, shape)` gives the tensors a Cedar tensor is stored as (`HFTensor`: name, shape, and for
a stacked expert weight the expert); `cedar_name` maps a Hugging Face name back; `dropped_reason` says why a tensor
Cedar does not model (DSpark / MTP layers, the vision tower) is dropped on import; `keeps_fp32` names what ships in
fp32 (mHC parameters, attention sinks, router biases); `hf_config` / `model_config` convert the config both ways
(ValueError naming a key Cedar does not model). Most names differ only by the `model.` prefix; docs/checkpoints.md
has the table of the exceptions.

Design and reasoning: docs/checkpoints.md#hugging-face-names-and-dtypes
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from model.config import ModelConfig
from model.engram_hash import engram_table_rows

# the HF key prefixes of what Cedar does not model: (prefix, why it is dropped)
DROPPED = (
    ("mtp.", "the DSpark / MTP draft layers (not modelled yet)"),
    ("model.mtp.", "the DSpark / MTP draft layers (not modelled yet)"),
    ("vision.", "the vision tower (not modelled)"),
    ("model.vision.", "the vision tower (not modelled)"),
    ("aligner.", "the vision aligner (not modelled)"),
    ("model.aligner.", "the vision aligner (not modelled)"),
)
_DROPPED_NAMES = ("image_start", "image_end", "image_newline")

# Cedar names whose HF tensors stay fp32 whatever the export dtype (REFERENCE A11)
_FP32_KEPT = re.compile(r"(\.hc_(attn|ffn)\.(fn|base|scale)|\.attn\.attn_sink|\.ffn\.gate\.(bias|bias_image))$")

_EXPERTS = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(w[123])$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
# One-to-one renames, (Cedar, HF), tried in order (the first that matches wins), in both directions. A `{name}` is a
# field: {i} a layer index, {site} attn or ffn, {part} an mHC parameter, {rest} the remaining path.
_FIELDS = {"i": r"\d+", "site": "attn|ffn", "part": "fn|base|scale", "rest": ".*"}
_RENAME_PAIRS = (
    ("embed.weight", "model.embed.weight"),
    ("norm.weight", "model.norm.weight"),
    ("head.weight", "lm_head.weight"),
    ("layers.{i}.hc_{site}.{part}", "model.layers.{i}.hc_{site}_{part}"),
    ("layers.{i}.ffn.gate.bias_image", "model.layers.{i}.ffn.gate.bias_vl"),
    ("layers.{i}.engram.table", "model.layers.{i}.engram.embed.weight"),
    ("layers.{rest}", "model.layers.{rest}"),
)


def _pattern(template: str) -> re.Pattern:
    """A rename template as an anchored regex whose named groups are its fields."""
    parts = re.split(r"\{(\w+)\}", template)  # literal, field, literal, field, ...
    return re.compile("^" + "".join(re.escape(p) if k % 2 == 0 else f"(?P<{p}>{_FIELDS[p]})"
                                    for k, p in enumerate(parts)) + "$")


_TO_HF = tuple((_pattern(cedar), hf) for cedar, hf in _RENAME_PAIRS)
_FROM_HF = tuple((_pattern(hf), cedar) for cedar, hf in _RENAME_PAIRS)


def _rename(name: str, rules) -> str | None:
    for pattern, template in rules:
        m = pattern.match(name)
        if m:
            return template.format(**m.groupdict())
    return None


@dataclass(frozen=True)
class HFTensor:
    """One HF tensor a Cedar tensor is stored as: its name, its shape, and which part of the Cedar tensor it holds
    (`expert`: the index along a stacked expert weight's dim 0, or None for the whole tensor)."""

    name: str
    shape: tuple[int, ...]
    expert: int | None = None


def hf_tensors(name: str, shape: tuple[int, ...]) -> list[HFTensor]:
    """Cedar tensor `name` of `shape` -> the HF tensors that store it (one, or one per expert)."""
    m = _EXPERTS.match(name)
    if m:
        layer, w = m.groups()
        return [HFTensor(f"model.layers.{layer}.ffn.experts.{e}.{w}.weight", tuple(shape[1:]), e)
                for e in range(shape[0])]
    hf_name = _rename(name, _TO_HF)
    if hf_name is not None:
        return [HFTensor(hf_name, tuple(shape))]
    raise KeyError(f"{name!r} has no Hugging Face name")


def cedar_name(hf_name: str) -> tuple[str, int | None] | None:
    """HF tensor name -> (the Cedar tensor it belongs to, the expert index along its dim 0 or None); None for a
    tensor Cedar does not model (`dropped_reason` says why) or that needs no tensor (an Engram table's scale)."""
    if dropped_reason(hf_name) is not None or hf_name.endswith(".engram.embed.scale"):
        return None
    m = _HF_EXPERT.match(hf_name)
    if m:
        layer, e, w = m.groups()
        return f"layers.{layer}.ffn.experts.{w}", int(e)
    name = _rename(hf_name, _FROM_HF)
    if name is not None:
        return name, None
    raise KeyError(f"{hf_name!r} is not a DeepSeek-V4.1 tensor name")


def dropped_reason(hf_name: str) -> str | None:
    """Why an HF tensor is not imported, or None when it is."""
    for prefix, why in DROPPED:
        if hf_name.startswith(prefix):
            return why
    if hf_name.split(".")[-1] in _DROPPED_NAMES or hf_name in _DROPPED_NAMES:
        return "the vision tower's image markers (not modelled)"
    return None


def keeps_fp32(name: str) -> bool:
    """A Cedar tensor the HF format keeps in fp32 whatever the export dtype (mHC parameters, sinks, router biases)."""
    return bool(_FP32_KEPT.search("." + name))


# -- config --------------------------------------------------------------------------------------------------------

# HF key -> Cedar field path (dots into ModelConfig), one-to-one both ways
_CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "attention.num_heads",
    "head_dim": "attention.head_dim",
    "q_lora_rank": "attention.q_lora_rank",
    "qk_rope_head_dim": "attention.rope_dim",
    "rope_theta": "attention.rope_theta",
    "compress_rope_theta": "attention.compress_rope_theta",
    "sliding_window": "attention.window",
    "o_groups": "attention.o_groups",
    "o_lora_rank": "attention.o_lora_rank",
    "compress_ratios": "csa2.compress_ratios",
    "kv_source_layer_ids": "csa2.kv_source_layers",
    "index_source_layer_ids": "csa2.index_source_layers",
    "candidate_source_layer_id": "csa2.candidate_source_layer",
    "candidate_topk_blocks": "csa2.candidate_topk_blocks",
    "candidate_block_size": "csa2.candidate_block_size",
    "index_n_heads": "csa2.index_num_heads",
    "index_head_dim": "csa2.index_head_dim",
    "index_topk": "csa2.index_topk",
    "moe_intermediate_size": "moe.expert_dim",
    "n_routed_experts": "moe.num_experts",
    "n_shared_experts": "moe.num_shared_experts",
    "num_experts_per_tok": "moe.experts_per_token",
    "routed_scaling_factor": "moe.routed_scale",
    "swiglu_limit": "moe.swiglu_limit",
    "hc_mult": "mhc.num_streams",
    "hc_sinkhorn_iters": "mhc.sinkhorn_iters",
    "hc_eps": "mhc.eps",
    "engram_layer_ids": "engram.layers",
    "engram_vocab_size": "engram.prime_start",
    "engram_max_ngram_size": "engram.max_ngram",
    "engram_n_heads": "engram.num_heads",
    "engram_head_dim": "engram.head_dim",
    "engram_pad_id": "engram.pad_id",
    "engram_compressed_vocab_size": "engram.compressed_vocab_size",
    "rms_norm_eps": "norm_eps",
    "initializer_range": "init_std",
    "tie_word_embeddings": "tie_embeddings",
    # DSpark (A1): the reference's names where it has them; the drafter's MoE size and window under names of ours
    "num_nextn_predict_layers": "dspark.num_layers",
    "dspark_target_layer_ids": "dspark.target_layers",
    "block_size": "dspark.block_size",
    "noise_token": "dspark.noise_token",
    "markov_rank": "dspark.markov_rank",
    "dspark_n_routed_experts": "dspark.num_experts",
    "dspark_num_experts_per_tok": "dspark.experts_per_token",
    "dspark_sliding_window": "dspark.window",
}
# what the reference computes one way only: the config must say it, or say nothing (its default)
_FIXED = {
    "num_key_value_heads": 1,
    "scoring_func": "sqrtsoftplus",
    "gate_temp": 1.0,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "attention_bias": False,
}
MODEL_TYPE = "deepseek_v41_text"


def _get(cfg, path: str):
    for part in path.split("."):
        cfg = cfg[part] if isinstance(cfg, dict) else getattr(cfg, part)
    return cfg


def _set(d: dict, path: str, value) -> None:
    *heads, last = path.split(".")
    for part in heads:
        d = d[part]
    d[last] = value


def hf_config(cfg: ModelConfig) -> dict:
    """The `config.json` of `cfg` in the reference's text-config layout (its field names, A1)."""
    out = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": MODEL_TYPE}
    for key, path in _CONFIG_KEYS.items():
        value = _get(cfg, path)
        out[key] = list(value) if isinstance(value, (list, tuple)) else value
    out.update(_FIXED)
    a = cfg.attention
    out["rope_scaling"] = {"rope_type": "yarn", "factor": a.yarn_factor, "beta_fast": a.yarn_beta_fast,
                           "beta_slow": a.yarn_beta_slow, "original_max_position_embeddings": a.yarn_original_max_pos}
    out["engram_num_embeddings"] = [engram_table_rows(cfg.engram, layer) for layer in cfg.engram.layers]
    if cfg.image_token_id >= 0:
        out["image_token_id"] = cfg.image_token_id
    out["torch_dtype"] = "bfloat16"
    return out


def model_config(hf: dict, base: ModelConfig | None = None) -> ModelConfig:
    """A Hugging Face `config.json` (the text config, or a composite one's `text_config`) -> ModelConfig, on top of
    `base` (default: the flagship's defaults) for what the file does not set. ValueError naming the key for a value
    Cedar does not model (another scoring function, several KV heads, a rope type other than YaRN)."""
    from omegaconf import OmegaConf

    text = dict(hf.get("text_config") or hf)
    d = dataclasses.asdict(base or ModelConfig())
    for key, want in _FIXED.items():
        if key in text and text[key] != want:
            raise ValueError(f"config.json: {key}={text[key]!r}; Cedar models {key}={want!r} only")
    for key, path in _CONFIG_KEYS.items():
        if key in text and text[key] is not None:
            value = text[key]
            _set(d, path, list(value) if isinstance(value, list) else type(_get(d, path))(value))
    scaling = text.get("rope_scaling") or {}
    if scaling:
        if scaling.get("rope_type", scaling.get("type")) != "yarn":
            raise ValueError(f"config.json: rope_scaling={scaling!r}; Cedar models YaRN only")
        for key, field in (("factor", "yarn_factor"), ("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                           ("original_max_position_embeddings", "yarn_original_max_pos")):
            if key in scaling:
                _set(d, f"attention.{field}", type(d["attention"][field])(scaling[key]))
    # trailing draft-layer entries of compress_ratios (always 0) are not Cedar's
    ratios = d["csa2"]["compress_ratios"] = d["csa2"]["compress_ratios"][:d["num_layers"]]
    decoder = [i for i, r in enumerate(ratios) if r == 1]  # CED: the encoder ends where ratio-1 layers begin
    if decoder:
        d["num_encoder_layers"] = decoder[0]
    image = hf.get("image_token_id", text.get("image_token_id"))
    if image is not None:
        d["image_token_id"] = int(image)
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), d))
    except Exception as e:  # a value of the wrong type
        raise ValueError(f"config.json: {str(e).splitlines()[0]}") from None
    rows = text.get("engram_num_embeddings")
    if rows:
        ours = [engram_table_rows(cfg.engram, layer) for layer in cfg.engram.layers]
        if list(rows) != ours:
            raise ValueError(f"config.json: engram_num_embeddings={list(rows)}, but the primes of engram_vocab_size="
                             f"{cfg.engram.prime_start} give {ours} rows")
    return cfg
