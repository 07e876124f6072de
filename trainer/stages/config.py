"""Typed schemas of the post-training stages: `stage=sft|rl|distill|dspark` (conf/stage/<name>.yaml).

Each stage's YAML starts with `defaults: [<name>_schema, _self_]`, so Hydra checks its keys against its own dataclass
at composition (a misspelled `stage.group_sise` fails naming the key); trainer/config.py's `to_config` builds the
stage section with the schema its `name` selects (`STAGE_SCHEMAS`). Every schema extends `StageConfig` (the hooks),
and the post-training ones turn the three hooks on by default (SPEC 1.3-1.5; each can be switched off).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from config_checks import at_least, check_choices, choice_field, positive

__all__ = ["StageConfig", "ModelRef", "SFTStageConfig", "RLStageConfig", "DistillStageConfig", "DSparkStageConfig",
           "STAGE_SCHEMAS"]


@dataclass
class StageConfig:
    name: str = choice_field("pretrain", ("pretrain", "sft", "rl", "distill", "dspark"))
    """the training stage (SPEC 2): pretrain, sft, rl, distill, dspark (each with its schema, `STAGE_SCHEMAS`)"""
    fp4_kv_qat: bool = False
    """hook: fake-quantise, in the training forward, what the inference cache quantises, as it stores it (main KV
    FP4 + E4M3 scales, indexer queries and keys FP4 + UE8M0, SWA KV FP8; per model.quant.cache_*), straight-through
    gradients (post-training, SPEC 1.4)"""
    bounded_replay_sim: bool = False
    """hook: at sampled cut points the training forward computes what serving's bounded replay rebuilds
    (model/replay.py; SPEC 1.5)"""
    replay_sim_prob: float = 0.5
    """per sequence and kind, the probability of a cut (uniform in [window, seq_len))"""
    replay_sim_kinds: list[str] = field(default_factory=lambda: ["decoder", "encoder"])
    """decoder: a replay="window" prefill; encoder: a prefix-cache hit whose SWA state expired"""
    hierarchical_indexer: bool = False
    """hook: the Reindex layers search only the candidate pool (model.csa2.hierarchical_pool=true; SPEC 1.3)"""

    def __post_init__(self) -> None:
        check_choices(self, "stage")
        if not 0.0 <= self.replay_sim_prob <= 1.0:
            raise ValueError(f"stage.replay_sim_prob must be in [0, 1], got {self.replay_sim_prob}")
        bad = [k for k in self.replay_sim_kinds if k not in ("decoder", "encoder")]
        if bad or not self.replay_sim_kinds:
            raise ValueError(f"stage.replay_sim_kinds must be a non-empty subset of [decoder, encoder], got "
                             f"{list(self.replay_sim_kinds)}")


@dataclass
class ModelRef:
    """A frozen model loaded from another run's checkpoint (a teacher)."""

    ckpt: str = ""
    """a checkpoint directory, a run's checkpoints/ folder (its newest complete checkpoint) or a run directory"""
    model: str = ""
    """conf/model/<name>.yaml when the checkpoint records no config; "" = the config the checkpoint records"""


@dataclass
class PostTrainingConfig(StageConfig):
    fp4_kv_qat: bool = True
    bounded_replay_sim: bool = True
    hierarchical_indexer: bool = True
    envs: List[str] = field(default_factory=lambda: ["arithmetic"])
    """data/envs/ environments the prompts (and SFT's generated samples) come from"""
    difficulty: List[int] = field(default_factory=list)
    """levels to draw from ([] = every level of each environment)"""
    effort: List[int] = field(default_factory=lambda: [1, 100])
    """[low, high]: reasoning efforts are drawn uniformly from this range"""
    eval_every: int = 25
    """steps between held-out evaluations (also at the start and the end; 0 = only those two)"""
    num_eval: int = 32
    """held-out prompts (or samples) per evaluation, drawn from a seed the training prompts never use"""
    allow_random_init: bool = False
    """true: start without checkpoint.init_from, from random weights (refused otherwise: post-training a random
    model is almost always a forgotten init_from)"""

    def _check_common(self, key: str) -> None:
        check_choices(self, key)
        if len(self.effort) != 2 or not 1 <= self.effort[0] <= self.effort[1] <= 100:
            raise ValueError(f"{key}.effort must be [low, high] with 1 <= low <= high <= 100, got {list(self.effort)}")
        at_least(f"{key}.eval_every", self.eval_every, 0)
        at_least(f"{key}.num_eval", self.num_eval, 1)
        if not self.envs:
            raise ValueError(f"{key}.envs must name at least one environment (data/envs/)")


@dataclass
class SFTStageConfig(PostTrainingConfig):
    name: str = choice_field("sft", ("sft",))
    data: str = ""
    """chat samples: a JSONL file, a glob or a directory of *.jsonl, or webdataset .tar shards ({"messages": [...]}
    per sample); "" = generated from `envs` (problems with worked answers, their length growing with the effort)"""
    envs: List[str] = field(default_factory=lambda: ["arithmetic", "strings"])
    num_samples: int = 4000
    """generated samples (data="" only)"""
    bucket_size: int = 64
    """length bucketing: batches are cut from runs of bucket_size x data.batch_size samples sorted by length"""
    fixed_length: bool = False
    """pad every batch to data.seq_len (else to its longest sample, rounded up to a multiple of 8)"""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_common("stage")
        at_least("stage.num_samples", self.num_samples, 1)
        at_least("stage.bucket_size", self.bucket_size, 1)


@dataclass
class RolloutConfig(PostTrainingConfig):
    """What RL and distillation share: prompts, sampling with the engine, and the policy-gradient loss."""

    prompts_per_step: int = 8
    """prompts of one optimiser step over the whole job (divided among the data ranks)"""
    train_prompts: int = 0
    """a fixed training set of this many prompts, drawn once from trainer.seed and visited in epochs (each a fresh
    shuffle), the rollouts' prompts and dynamic sampling's refills taken from it; 0 = fresh prompts every step"""
    group_size: int = 8
    """G: samples per prompt"""
    max_new_tokens: int = 24
    temperature: float = 1.0
    """sampling temperature; the training forward scores the same tempered distribution"""
    rollout_replay: str = choice_field("auto", ("auto", "halo", "window", "none"))
    """the engine's prefill (model/cache.py): `window` is SWA bounded replay, `halo` and `none` are exact; auto =
    window when bounded_replay_sim is on, else halo. Under a window prefill with bounded_replay_sim the training
    forward simulates the engine's cut at each prompt's end (model/replay.py), so train and rollout compute alike"""
    replay_routing: bool = True
    """rollout replay: the training forward reuses the engine's top-k and expert choices (model/routing.py)"""
    eps_low: float = 0.2
    eps_high: float = 0.28
    """clip-higher: the ratio is clipped to [1 - eps_low, 1 + eps_high]"""
    tis_cap: float = 2.0
    """truncated importance sampling: each token's loss times min(pi_train / pi_rollout, tis_cap) (0 = off)"""
    max_batch: int = 64
    """engine rows decoding together"""
    rollout_kernels: str = choice_field("reference", ("reference", "triton", "auto"))
    """the decode step's attention and indexer: the reference operations, or the serving kernels that read the
    cache's stored bytes (model/serving_decode.py; auto = triton on a GPU); Engine(serving_kernels=)"""
    rollout_cuda_graph: str = choice_field("auto", ("auto", "on", "off"))
    """the engine's decode steps replayed from a CUDA graph (Engine(cuda_graph=True), routing records included):
    auto = on for a one-process run on a GPU, off otherwise (a parallel plan's collectives are not captured)"""
    rollout_compile: str = choice_field("off", ("off", "inductor"))
    """the engine's decode step through torch.compile (Engine(compile_decode=)): with the CUDA graph, the compiled
    step is what it captures (on an H100 at v41_small with the triton kernels 9.6 ms a step against 19.5, BENCHMARKS.md);
    it compiles once for each engine batch size and keep flag (minutes a shape at v41_small)"""

    def _check_rollout(self) -> None:
        for key in ("prompts_per_step", "group_size", "max_new_tokens", "max_batch"):
            at_least(f"stage.{key}", getattr(self, key), 1)
        at_least("stage.train_prompts", self.train_prompts, 0)
        positive("stage.temperature", self.temperature)
        for key in ("eps_low", "eps_high", "tis_cap"):
            at_least(f"stage.{key}", getattr(self, key), 0.0)
        if self.tis_cap and self.tis_cap < 1.0:
            raise ValueError(f"stage.tis_cap must be 0 (off) or >= 1, got {self.tis_cap}")


@dataclass
class RLStageConfig(RolloutConfig):
    name: str = choice_field("rl", ("rl",))
    adv_norm: str = choice_field("std", ("std", "mean"))
    """group-normalised advantages: (r - mean) / std over the G samples (std), or r - mean (mean: Dr. GRPO)"""
    dynamic_sampling: bool = True
    """drop groups whose rewards do not vary (no gradient signal), drawing more prompts up to max_rounds times"""
    max_rounds: int = 3
    kl_coef: float = 0.0
    """KL to the reference model (the init_from weights), unbiased K3 estimator; 0 = off (no reference is kept)"""
    length_penalty: float = 1.0
    """effort control: a correct response of L tokens at effort e earns reward x exp(-length_penalty x (100 - e) / 100
    x L / max_new_tokens): at effort 100 no penalty, lower efforts pay more per token"""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_common("stage")
        self._check_rollout()
        at_least("stage.max_rounds", self.max_rounds, 1)
        at_least("stage.kl_coef", self.kl_coef, 0.0)
        at_least("stage.length_penalty", self.length_penalty, 0.0)


@dataclass
class DistillStageConfig(RolloutConfig):
    name: str = choice_field("distill", ("distill",))
    teacher: ModelRef = field(default_factory=ModelRef)
    """the default teacher (stage.teacher.ckpt=<path>, stage.teacher.model=<model config> when it differs)"""
    teachers: dict = field(default_factory=dict)
    """per task family (data/envs/: math, string, code), a teacher {ckpt, model} for that family's prompts;
    families not listed use `teacher`"""
    tis_cap: float = 0.0
    kl: str = choice_field("full", ("full", "sampled"))
    """the loss: full = each completion position's exact reverse KL(student || teacher) over the vocabulary, at the
    student's own samples, differentiated directly (the teacher's log-softmax rides in the batch: [tokens, vocab]
    floats); sampled = the policy gradient with advantage = teacher - student log-prob of the sampled token"""
    kl_baseline: bool = True
    """kl=sampled: add each position's exact reverse KL (over the vocabulary) to its token's advantage: the advantage's
    expectation there, so it is centred per position (unbiased; without it the advantages average -KL and push down
    every sampled token: trainer/stages/distill.py)"""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_common("stage")
        self._check_rollout()
        if not self.teacher.ckpt and not self.teachers:
            raise ValueError("stage.teacher.ckpt is required: the checkpoint (or run directory) of the teacher")
        for family, ref in self.teachers.items():
            if not isinstance(ref, dict) or not ref.get("ckpt") or set(ref) - {"ckpt", "model"}:
                raise ValueError(f"stage.teachers.{family} must be {{ckpt: <path>, model: <optional config>}}, "
                                 f"got {ref!r}")


@dataclass
class DSparkStageConfig(StageConfig):
    """The drafter's training on the frozen backbone (trainer/stages/dspark.py); the model's drafter shape is
    model.dspark. The hooks stay off by default: the backbone computes as it was trained (turn fp4_kv_qat on to
    draft against the distributions of a quantised cache)."""

    name: str = choice_field("dspark", ("dspark",))
    anchors: int = 16
    """anchors drawn per training sequence (without replacement, among positions whose next token counts)"""
    heldout_rows: int = 1
    """rows of each micro-batch not trained on: their anchors (whole blocks only) measure acceptance_len and
    predicted_acceptance_len"""
    ce_coef: float = 0.1
    l1_coef: float = 0.9
    conf_coef: float = 1.0
    """the loss's weights (REFERENCE B6: DeepSpec's a_ce, a_l1, a_conf)"""
    gamma: float = 4.0
    """slot k's weight exp(-k / gamma)"""
    generated_rows: int = 0
    """training rows of each micro-batch whose text after their first `generation_prefix` tokens is the backbone's
    own sampled continuation (the engine, seeded per step and row): the drafter then also learns what the model
    writes, as served; 0 = the training data alone"""
    generation_prefix: int = 16
    """tokens of the data row kept as the prompt of a generated row"""
    generation_temperature: float = 1.0
    """the backbone's sampling temperature for generated rows (0 = greedy)"""

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least("stage.anchors", self.anchors, 1)
        at_least("stage.generated_rows", self.generated_rows, 0)
        at_least("stage.generation_prefix", self.generation_prefix, 1)
        at_least("stage.generation_temperature", self.generation_temperature, 0.0)
        at_least("stage.heldout_rows", self.heldout_rows, 0)
        for key in ("ce_coef", "l1_coef", "conf_coef"):
            at_least(f"stage.{key}", getattr(self, key), 0.0)
        positive("stage.gamma", self.gamma)


STAGE_SCHEMAS = {"pretrain": StageConfig, "sft": SFTStageConfig, "rl": RLStageConfig, "distill": DistillStageConfig,
                 "dspark": DSparkStageConfig}
