"""Typed model configuration: the Hydra schema of the `model` config group.

Every field documents where its value comes from (SPEC.md / REFERENCE.md) or why we chose it.
`__post_init__` checks single fields; cross-field rules (the layer plan) live in `model.layer_plan`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from config_checks import at_least, check_choices, choice_field, positive

# OmegaConf 2.3 has no Literal support: closed sets are `choice_field`s, checked by `check_choices` in __post_init__.


@dataclass
class AttentionConfig:
    num_heads: int = 64
    """query heads; all share one K=V latent (MQA over the compressed latent)"""
    head_dim: int = 512
    """width of the shared latent and of each query head"""
    rope_dim: int = 64
    """trailing channels that rotate (interleaved pairs); the rest pass through"""
    q_lora_rank: int = 1280
    """low-rank query bottleneck: wq_a (dim -> rank), q_norm, wq_b (rank -> heads * head_dim)"""
    o_groups: int = 8
    """grouped output projection: heads split in o_groups groups, each projected to o_lora_rank"""
    o_lora_rank: int = 1024
    window: int = 128
    """sliding window (keys per query, the query's own token included)"""
    rope_theta: float = 1e4
    """RoPE base of SWA-only layers ('main' rope)"""
    compress_rope_theta: float = 1.6e5
    """RoPE base of compressed layers (window and compressed branch alike)"""
    yarn_factor: float = 16.0
    """YaRN on compressed layers; 1.0 turns it off. attention_factor is 1 (no mscale), as in the reference."""
    yarn_original_max_pos: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "rope_dim", "q_lora_rank", "o_groups", "o_lora_rank", "window"):
            positive(f"model.attention.{name}", getattr(self, name))
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ValueError(f"model.attention.rope_dim must be even and <= head_dim, got {self.rope_dim}")
        if self.num_heads % self.o_groups:
            raise ValueError(
                f"model.attention.o_groups={self.o_groups} must divide num_heads={self.num_heads}"
            )


@dataclass
class CSA2Config:
    compress_ratios: list[int] = field(default_factory=lambda: [0, 0] + [2] * 18 + [1] * 20)
    """per layer: 0 = SWA only, m >= 1 = m tokens per compressed entry"""
    kv_source_layers: list[int] = field(default_factory=lambda: [2, 8, 14, 20])
    """Full layers: own compressor (main KV) and indexer keys"""
    index_source_layers: list[int] = field(default_factory=lambda: [2, 8, 14, 20, 24, 28, 32, 36])
    """Full + Reindex layers: run their own indexer queries and top-k"""
    index_num_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    hierarchical_pool: bool = True
    """switch: Reindex layers search only the candidate pool built at candidate_source_layer"""
    candidate_source_layer: int = 20
    """the Full layer that builds the pool; -1 = none"""
    candidate_block_size: int = 8
    candidate_topk_blocks: int = 2048

    def __post_init__(self) -> None:
        for name in ("index_num_heads", "index_head_dim", "index_topk", "candidate_block_size",
                     "candidate_topk_blocks"):
            positive(f"model.csa2.{name}", getattr(self, name))
        bad = [r for r in self.compress_ratios if r < 0]
        if bad:
            raise ValueError(f"model.csa2.compress_ratios must be >= 0, got {bad[0]}")


@dataclass
class IndexerTrainConfig:
    phase: str = choice_field("sparse", ("dense_warmup", "sparse"))
    """dense_warmup: attention over all visible entries, only indexers learn; sparse: top-k attention"""
    loss_coef: float = 1.0
    """weight of the indexer KL loss in the total loss"""

    def __post_init__(self) -> None:
        check_choices(self, "model.indexer")
        at_least("model.indexer.loss_coef", self.loss_coef, 0)


@dataclass
class MoEConfig:
    num_experts: int = 384
    num_shared_experts: int = 1
    experts_per_token: int = 6
    expert_dim: int = 2304
    routed_scale: float = 1.5
    swiglu_limit: float = 10.0
    """clamp: up-projection to [-limit, limit], gate capped above at limit"""
    bias_update_rate: float = 1e-3
    """aux-loss-free balancing: bias += rate * sign(mean_load - load) per update"""
    seq_aux_loss_coef: float = 0.0
    """optional small sequence-wise balance loss (0 = off)"""

    def __post_init__(self) -> None:
        for name in ("num_experts", "experts_per_token", "expert_dim"):
            positive(f"model.moe.{name}", getattr(self, name))
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"model.moe.experts_per_token={self.experts_per_token} exceeds num_experts={self.num_experts}"
            )
        at_least("model.moe.num_shared_experts", self.num_shared_experts, 0)


@dataclass
class MHCConfig:
    num_streams: int = 4
    sinkhorn_iters: int = 20
    eps: float = 1e-6
    impl: str = choice_field("single_pass", ("single_pass", "unfused"))
    """both compute the same function; single_pass is the fused formulation (SPEC 1.6)"""

    def __post_init__(self) -> None:
        check_choices(self, "model.mhc")
        positive("model.mhc.num_streams", self.num_streams)
        positive("model.mhc.sinkhorn_iters", self.sinkhorn_iters)


@dataclass
class EngramConfig:
    layers: list[int] = field(default_factory=lambda: [1, 14])
    """the model layers that get an Engram, each its own table (flagship: 1 and 14); it acts on the streams at the
    start of the layer, before attention. Each in [0, num_layers), no duplicates (model/layer_plan.py checks), any
    number, [] = no Engram. The order gives each layer its primes (the first listed takes the smallest), so
    reordering changes the table sizes and old checkpoints no longer fit"""
    max_ngram: int = 4
    """n-gram orders 2..max_ngram"""
    num_heads: int = 8
    """hash heads per order, each with its own prime-sized table"""
    head_dim: int = 256
    prime_start: int = 16_000_000
    """tables take consecutive primes above this, never reused across layers (flagship: 384,006,168 and
    384,016,682 rows)"""
    compressed_vocab_size: int = 99_092
    """size of the canonicalised vocabulary (bounds the hash multipliers so id * mult fits in int64)"""
    pad_id: int = 2
    """token id whose canonical id stands in for missing history"""
    table_dtype: str = choice_field("float32", ("float32", "bfloat16"))
    """storage dtype of the tables"""

    def __post_init__(self) -> None:
        for name in ("max_ngram", "num_heads", "head_dim", "prime_start", "compressed_vocab_size"):
            positive(f"model.engram.{name}", getattr(self, name))
        check_choices(self, "model.engram")
        at_least("model.engram.max_ngram", self.max_ngram, 2)


@dataclass
class QuantConfig:
    main_kv: str = choice_field("none", ("none", "fp4"))
    """compressed (main) KV fake-quant: FP4 E2M1, E4M3 scale per 16 (QAT hook turns it on)"""
    index: str = choice_field("none", ("none", "fp4"))
    """indexer q and k fake-quant: FP4 E2M1, UE8M0 scale per 32"""
    swa_kv: str = choice_field("none", ("none", "fp8"))
    """SWA KV fake-quant: FP8 E4M3, UE8M0 scale per 32"""
    cache_main_kv: str = choice_field("fp4", ("fp4", "fp8", "bf16", "none"))
    """storage format of the inference cache's main KV (model/cache.py) and of its byte accounting (SPEC 1.4);
    none = the compute dtype (serving then computes exactly what the training forward computes)"""
    cache_index: str = choice_field("fp4", ("fp4", "fp8", "bf16", "none"))
    """storage of the indexer keys: fp4 = E2M1 with a UE8M0 scale per 32"""
    cache_swa_kv: str = choice_field("fp8", ("fp8", "bf16", "none"))
    """storage of the SWA ring: fp8 = E4M3 with a UE8M0 scale per 32"""

    def __post_init__(self) -> None:
        check_choices(self, "model.quant")


@dataclass
class DSparkConfig:
    """DSpark, the speculative-decoding drafter (SPEC 1.6, REFERENCE B6; model/dspark.py): `num_layers` SWA blocks
    fed from the backbone's `target_layers`, one forward drafting `block_size` tokens, a Markov head and a confidence
    head. It shares the backbone's embedding, head, attention shape and mHC; its MoE is its own size."""

    num_layers: int = 3
    """draft blocks (the reference's num_nextn_predict_layers)"""
    target_layers: List[int] = field(default_factory=lambda: [37, 38, 39])
    """backbone layers whose entering residual (the mean over mHC streams) makes the drafter's context; the
    reference's default: the last three layers that are not KV sources. [] = none (no drafter in this config)"""
    block_size: int = 5
    """draft tokens per forward: the anchor (last accepted token) and block_size - 1 noise tokens"""
    window: int = 128
    """context positions each draft query sees (the last `window` before the anchor); at most the backbone's
    window (serving keeps the backbone's hidden states of the last window rows only, REFERENCE B3)"""
    markov_rank: int = 256
    """the Markov head's rank: logits_k += W2 W1[x_{k-1}]"""
    noise_token: int = 128_799
    """the token id filling the block's slots after the anchor"""
    num_experts: int = 128
    experts_per_token: int = 3

    # (its rules against the backbone, layers, window and vocabulary, are checked where a drafter is built,
    # model.dspark.drafter_config: a backbone shrunk by overrides, as tests do, keeps a valid config)
    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "window", "markov_rank", "num_experts", "experts_per_token"):
            positive(f"model.dspark.{name}", getattr(self, name))
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"model.dspark.experts_per_token={self.experts_per_token} exceeds num_experts="
                             f"{self.num_experts}")


@dataclass
class VisionConfig:
    """DeepSeek-ViT, the image tower, and its aligner into the backbone (SPEC 1.6, REFERENCE A12; model/vision/):
    a linear patch embedding, `num_layers` pre-norm blocks (RMSNorm, bidirectional attention with 2-D RoPE inside
    each image, RMSNorm, SwiGLU MLP), a final RMSNorm, an `unshuffle` x `unshuffle` pixel-unshuffle and an MLP
    aligner to the backbone's width. num_layers 0 (the default) = text only: no tower, nothing built or counted."""

    num_layers: int = 0
    """ViT blocks; 0 = no vision tower (the flagship's 32 are set in conf/model/v41_flash.yaml)"""
    dim: int = 1024
    """the ViT's width (SPEC 1.6: hidden 1024)"""
    num_heads: int = 16
    """attention heads (REFERENCE A12: 16); head dim = dim / num_heads, a multiple of 4 (2-D RoPE: a rotated half
    per axis, each in pairs)"""
    mlp_dim: int = 4096
    """the SwiGLU MLP's width. An assumption: no public source gives it (4 x dim, a ViT-L's MLP width)"""
    patch: int = 14
    """patch side in pixels; a patch is 3 x patch x patch values (SPEC 1.6, REFERENCE A12)"""
    unshuffle: int = 3
    """pixel-unshuffle factor: each unshuffle x unshuffle block of patches becomes one image token (1/9 of them)"""
    rope_theta: float = 1e4
    """2-D RoPE base (REFERENCE A12)"""
    norm_eps: float = 1e-6
    """every RMSNorm of the tower. An assumption: the reference does not give it (the backbone's 1e-20 is its own)"""
    max_tokens: int = 1024
    """the most placeholder tokens one image may take, (h/u)(w/u + 1) + 2 for a grid of h x w patches: the
    processor shrinks larger images (REFERENCE A12 step 5), so 1024 allows a square of 31 x 31 image tokens,
    1302 x 1302 pixels ("up to about 1344 x 1344", SPEC 1.6)"""

    def __post_init__(self) -> None:
        at_least("model.vision.num_layers", self.num_layers, 0)
        for name in ("dim", "num_heads", "mlp_dim", "patch", "unshuffle", "rope_theta"):
            positive(f"model.vision.{name}", getattr(self, name))
        at_least("model.vision.norm_eps", self.norm_eps, 0)
        at_least("model.vision.max_tokens", self.max_tokens, 4)  # one token: START, IMAGE, NEWLINE, END
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 4:
            raise ValueError(f"model.vision.num_heads={self.num_heads} must divide model.vision.dim={self.dim} into "
                             "heads whose dim is a multiple of 4 (2-D RoPE rotates pairs, half by row, half by column)")


@dataclass
class ModelConfig:
    name: str = "v41_flash"
    vocab_size: int = 129_280
    dim: int = 5120
    num_layers: int = 40
    num_encoder_layers: int = 20
    """CED: layers [0, num_encoder_layers) are the encoder; the decoder's global KV comes from their output"""
    norm_eps: float = 1e-20
    """every RMSNorm (the reference uses 1e-20)"""
    init_std: float = 0.02
    image_token_id: int = -1
    """-1: text only"""
    tie_embeddings: bool = False
    kernels: str = choice_field("auto", ("reference", "triton", "auto"))
    """auto: triton on CUDA, reference elsewhere"""
    fp8_gemm: bool = False
    """FP8 GEMMs as DeepSeek-V3 trains (kernels.fp8_gemm): routed and shared experts and the attention's wq_a, wq_b,
    wkv, wo_a, wo_b, each where its in and out dims are multiples of 128 (the others stay in the compute dtype)"""
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    csa2: CSA2Config = field(default_factory=CSA2Config)
    indexer: IndexerTrainConfig = field(default_factory=IndexerTrainConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mhc: MHCConfig = field(default_factory=MHCConfig)
    engram: EngramConfig = field(default_factory=EngramConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    dspark: DSparkConfig = field(default_factory=DSparkConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    """the image tower (model/vision/); num_layers 0 = text only"""

    def __post_init__(self) -> None:
        check_choices(self, "model")
        for name in ("vocab_size", "dim", "num_layers", "num_encoder_layers"):
            positive(f"model.{name}", getattr(self, name))
        if self.num_encoder_layers >= self.num_layers:
            raise ValueError(
                f"model.num_encoder_layers={self.num_encoder_layers} must be < num_layers={self.num_layers}"
            )
        if len(self.csa2.compress_ratios) != self.num_layers:
            raise ValueError(
                f"model.csa2.compress_ratios has {len(self.csa2.compress_ratios)} entries, "
                f"num_layers={self.num_layers}"
            )
