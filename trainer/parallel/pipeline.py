"""Pipeline parallelism for the CED backbone: where to cut (`split_points`, `allowed_cuts`), the stage modules
(`PipelineStageModule`, `split_model`), the last stage's loss (`PipelineLoss`) and the torch.distributed.pipelining
schedules that drive them (`SCHEDULES`, `build_pipeline`: 1F1B, interleaved 1F1B, and the zero-bubble ZBV and
interleaved schedules, with our own split backward). What crosses a cut is trainer/parallel/pipeline_wire.py.

Contract: a stage computes exactly what its layers compute inside the whole model; cuts fall only in front of a
layer that reuses no earlier top-k (unless `any_layer=True`). Stage modules keep the model's parameter names
(`layers` keyed by global layer index), so state dicts and checkpoints match the whole model. Shapes are static:
every micro-batch must have B rows of T tokens. The last stage's loss is lm + coef * kl_sum / kl_count +
seq_balance. Needs torch >= PIPELINE_MIN_TORCH (`check_torch_version`); on torch < 2.13 `_FLOAT_WIRE` is on
(the float wire: integer slots cross as float32 carriers, docs/parallelism.md#pipeline-wire-format).

Design and reasoning: docs/parallelism.md#pipeline-parallelism
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from model.config import ModelConfig
from model.forward import ForwardState, add_expert_loads, embed_streams, forward_blocks, head_logits, new_state
from model.layer_plan import LayerSpec
from model.moe import MoE
from model.transformer import Transformer
from trainer.loss import LMLoss, StepTokens, valid_tokens
from trainer.parallel.pipeline_wire import (
    KV_SLOTS,
    Slot,
    boundary_slots,
    carried_count,
    from_carrier,
    is_carried,
    pack_bits,
    slot_meta,
    to_carrier,
    unpack_bits,
)
from trainer.parallel.zero_bubble import OLD_PIPELINING, ContiguousGrad, Tie, ZeroBubbleStage, ZeroGrad

__all__ = [
    "SCHEDULES", "PipelineStageModule", "PipelineLoss", "Pipeline", "allowed_cuts", "split_points",
    "stage_ids_for_rank", "split_model", "build_pipeline", "check_torch_version",
]

# schedule name -> (class, stage placement: "loop" puts stage s on rank s % pp, "v" puts rank r's two stages at
# r and 2*pp - 1 - r)
SCHEDULES = {
    "1F1B": (Schedule1F1B, "loop"),
    "Interleaved1F1B": (ScheduleInterleaved1F1B, "loop"),
    "InterleavedZeroBubble": (ScheduleInterleavedZeroBubble, "loop"),
    "ZBVZeroBubble": (ScheduleZBVZeroBubble, "v"),
}


# ---------------------------------------------------------------------------------------------------------------------
# Where to cut


def allowed_cuts(plan: Sequence[LayerSpec], any_layer: bool = False) -> list[int]:
    """Layers a stage may start at: every layer but the first that does not reuse an earlier layer's top-k
    (any_layer: every layer but the first)."""
    return [s.index for s in plan[1:] if any_layer or s.role != "reuse"]


def split_points(plan: Sequence[LayerSpec], num_stages: int, *, embed_cost: float = 1.0, head_cost: float = 1.0,
                 carried: Callable[[int], float] | None = None, any_layer: bool = False) -> list[int]:
    """Cut the layers into `num_stages` (pp x pp_virtual) contiguous stages; returns the num_stages - 1 cut points
    (the first layer of every stage but the first).

    Minimises the largest stage cost (layer count, + embed_cost on the first stage, + head_cost on the last) over
    `allowed_cuts`; among equally balanced splits, the one whose cuts carry least (`carried(cut)`, default the
    number of state tensors crossing it; pass e.g. `lambda c: pipeline_wire.boundary_bytes(cfg, c, 1, T)` to
    count bytes).
    any_layer: allow cuts in front of Reuse layers too (better balance; each such cut also ships a top-k).
    Raises ValueError when the layers cannot make that many stages."""
    num_layers = len(plan)
    cuts = allowed_cuts(plan, any_layer)
    if num_stages < 1:
        raise ValueError(f"pipeline: the number of stages (pp x pp_virtual) must be >= 1, got {num_stages}")
    if num_stages > len(cuts) + 1:
        where = ("any layer" if any_layer else "an SWA layer or a Full/Reindex group start")
        raise ValueError(
            f"pipeline: cannot split num_layers={num_layers} into {num_stages} pipeline stages (pp x pp_virtual): "
            f"a stage may only start at {where}, layers {cuts}, which allows at most {len(cuts) + 1} stages"
            + ("" if any_layer else "; any_layer=True also cuts inside groups (one top-k more per such cut)"))
    carried = carried or (lambda c: float(carried_count(plan, c)))
    bounds = [0] + cuts + [num_layers]  # candidate stage boundaries
    last = len(bounds) - 1

    def cost(i: int, j: int) -> float:  # stage from bounds[i] to bounds[j]
        return bounds[j] - bounds[i] + (embed_cost if i == 0 else 0.0) + (head_cost if j == last else 0.0)

    # best[k][j]: (max stage cost, carried state) of the best split of layers [0, bounds[j]) into k stages
    inf = (math.inf, math.inf)
    best = [[inf] * (last + 1) for _ in range(num_stages + 1)]
    prev = [[-1] * (last + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, num_stages + 1):
        for j in range(1, last + 1):
            for i in range(j):
                if best[k - 1][i] == inf:
                    continue
                edge = carried(bounds[i]) if i > 0 else 0.0
                cand = (max(best[k - 1][i][0], cost(i, j)), best[k - 1][i][1] + edge)
                if cand < best[k][j]:
                    best[k][j], prev[k][j] = cand, i
    out, j = [], last
    for k in range(num_stages, 0, -1):
        j = prev[k][j]
        out.append(bounds[j])
    return sorted(out)[1:]


def stage_ids_for_rank(pp_rank: int, pp: int, num_virtual: int, schedule: str) -> list[int]:
    """The global stage indices rank `pp_rank` of `pp` holds, in the placement the schedule expects."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    style = SCHEDULES[schedule][1]
    if schedule == "1F1B" and num_virtual != 1:
        raise ValueError(f"schedule 1F1B runs one stage per rank; got pp_virtual={num_virtual} "
                         "(use Interleaved1F1B or a zero-bubble schedule)")
    if style == "v":
        if num_virtual != 2:
            raise ValueError(f"schedule {schedule} needs exactly pp_virtual=2 stages per rank, got {num_virtual}")
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(num_virtual)]


# Non-floating slots cross as float32 carriers of their exact bytes (the float wire: the module docstring, and
# trainer/parallel/pipeline_wire.py's). Read by PipelineStageModule.set_shapes, which passes it down to the wire
# functions; tests force it on under torch 2.13.
_FLOAT_WIRE = OLD_PIPELINING


# ---------------------------------------------------------------------------------------------------------------------
# Stage modules


class PipelineStageModule(nn.Module):
    """Layers [start, end) of the backbone, plus the embedding and Engram hasher on the first stage and the final
    norm + head on the last. forward(*inputs) -> outputs, both tuples of tensors laid out by `boundary_slots`
    (the first stage takes (input_ids [B, T], [image_mask [B, T]]); the last returns (logits [B, T, V] fp32,
    aux [3])). Parameter names are the whole model's."""

    def __init__(self, model: Transformer, bounds: Sequence[int], stage_index: int, *, image_mask: bool = False):
        super().__init__()
        cfg = model.cfg
        start, end = bounds[stage_index], bounds[stage_index + 1]
        self.cfg, self.start, self.end = cfg, start, end
        self.stage_index, self.num_stages = stage_index, len(bounds) - 1
        self.is_first, self.is_last = start == 0, end == cfg.num_layers
        self.uses_image_mask = image_mask
        self.autocast_dtype: torch.dtype | None = None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(start, end)})
        # context parallelism's hooks (a plain object, see model.forward.SequenceShard); set it on the stage too
        self.sequence_shard = model.sequence_shard
        self.hasher = model.hasher if self.is_first else None  # hashing runs once, on the first stage
        if self.is_first:
            self.embed = model.embed
        if self.is_last:
            self.norm = model.norm
            self.head = model.head
        self._in: tuple[Slot, ...] = ()
        self._out: tuple[Slot, ...] = ()

    def set_shapes(self, batch: int, seq_len: int, act_dtype: torch.dtype | None = None,
                   autocast_dtype: torch.dtype | None = None, context_len: int | None = None,
                   sequence_shards: int = 1) -> None:
        """Fix the micro-batch shape (static pipeline metadata) and the wire layout of both boundaries.
        act_dtype: the streams' dtype (default the parameters'; the compute dtype under an FSDP mixed-precision
        policy); autocast_dtype: run forward under torch.autocast with it (the trainer's bf16 mode); context_len:
        see boundary_slots (context parallelism); sequence_shards: tp under sequence parallelism (boundary_slots).
        batch and seq_len are the whole micro-batch (this process's chunk under cp): the first stage takes those
        token ids, the last returns those logits, whatever crosses in between."""
        act = act_dtype or (self.embed if self.is_first else next(iter(self.layers.values())).attn_norm).weight.dtype
        self.act_dtype, self.autocast_dtype = act, autocast_dtype
        # The Triton attention path keeps the top-k and the pool as int32 ids; they cross as such (model/kernels.py)
        path = next(iter(self.layers.values())).attn.kernel_path
        kw = dict(act_dtype=act, autocast_dtype=autocast_dtype, image_mask=self.uses_image_mask,
                  context_len=context_len, ids=path == "triton", sequence_shards=sequence_shards)
        self.float_wire = _FLOAT_WIRE  # fixed here: the metadata, _pack and _unpack must agree
        self._in = () if self.is_first else boundary_slots(self.cfg, self.start, batch, seq_len, **kw)
        self._out = () if self.is_last else boundary_slots(self.cfg, self.end, batch, seq_len, **kw)
        self.batch, self.seq_len = batch, seq_len

    # -- set-up, mirroring Transformer ---------------------------------------------------------------------------
    def init_weights(self) -> None:
        """This stage's part of Transformer.init_weights. The random draws differ from the whole model's (each
        stage draws only its own tensors): to start from the single process's weights, load them by name."""
        std = self.cfg.init_std
        if self.is_first:
            nn.init.normal_(self.embed.weight, std=std)
        if self.is_last:
            nn.init.normal_(self.head.weight, std=std)
            self.norm.init_weights()
        for layer in self.layers.values():
            layer.init_weights()
        if self.is_first and self.hasher is not None:
            self.hasher.init_buffers()

    def set_canonical_vocab(self, canonical_map: torch.Tensor) -> None:
        if self.is_first and self.hasher is not None:
            self.hasher.set_canonical_map(canonical_map)

    def moe_layers(self) -> list[MoE]:
        return [layer.ffn for layer in self.layers.values()]

    # -- forward -------------------------------------------------------------------------------------------------
    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        """Meta tensors with the shapes, dtypes and requires_grad of forward's inputs (PipelineStage metadata)."""
        if self.is_first:
            ids = [torch.empty(self.batch, self.seq_len, dtype=torch.int64, device="meta")]
            if self.uses_image_mask:
                ids.append(torch.empty(self.batch, self.seq_len, dtype=torch.bool, device="meta"))
            return tuple(ids)
        return tuple(slot_meta(s, self.float_wire) for s in self._in)

    def example_outputs(self) -> tuple[torch.Tensor, ...]:
        if self.is_last:
            logits = torch.empty(self.batch, self.seq_len, self.cfg.vocab_size, device="meta").requires_grad_()
            return logits, torch.empty(3, device="meta").requires_grad_()
        return tuple(slot_meta(s, self.float_wire) for s in self._out)

    def forward(self, *inputs: torch.Tensor):
        device_type = inputs[0].device.type
        # The zero-bubble hooks (trainer/parallel/zero_bubble.py): every received tensor that carries a gradient goes
        # through ContiguousGrad (its input gradient leaves contiguous, as gloo's send needs), and every output that
        # carries one through Tie to a received tensor (every differentiable output is on autograd's path from the
        # stage inputs, where the input pass saves the gradients the weight pass starts from).
        anchor = next((t for t in inputs if t.requires_grad), None)
        if anchor is not None:
            inputs = tuple(ContiguousGrad.apply(t) if t.requires_grad else t for t in inputs)
        with torch.autocast(device_type, dtype=self.autocast_dtype or torch.float32,
                            enabled=self.autocast_dtype is not None):
            out = self._forward(inputs)
        if anchor is None:
            return out
        out = tuple(Tie.apply(t, anchor) if t.requires_grad else t for t in out)
        # Float wire: the received carriers (which the stage reads only through their detached bytes) get an exact
        # zero gradient, through the first differentiable output, so that every received tensor has a gradient to
        # send back (torch 2.11's PipelineStage needs one; see the module docstring).
        carriers = [t for s, t in zip(self._in, inputs) if is_carried(s, self.float_wire) and t.requires_grad]
        if carriers:
            i = next(i for i, t in enumerate(out) if t.requires_grad)
            out = out[:i] + (ZeroGrad.apply(out[i], *carriers),) + out[i + 1:]
        return out

    def _forward(self, inputs):
        cfg = self.cfg
        if self.is_first:
            input_ids = inputs[0]
            image_mask = inputs[1] if self.uses_image_mask else None
            state, engram_in = new_state(cfg, input_ids, self.sequence_shard, self.hasher, image_mask)
            S, pre = embed_streams(self.embed, input_ids, cfg.mhc.num_streams)
            aux = torch.zeros(3, device=input_ids.device)
        else:
            S, pre, state, engram_in, image_mask, aux = self._unpack(inputs)
        S, pre = forward_blocks(self.layers.values(), S, pre, state, cfg.num_encoder_layers, engram_in, image_mask)
        add_expert_loads(self.layers.values(), state)
        aux = aux + self._aux(state, S.device)
        if self.is_last:
            return head_logits(self.norm, self.head, S, pre), aux
        return self._pack(S, pre, state, engram_in, image_mask, aux)

    def _aux(self, state: ForwardState, device) -> torch.Tensor:
        """[indexer KL sum, number of KL terms, MoE sequence-balance sum] of this stage's layers."""
        zero = torch.zeros((), device=device)
        kl = list(state.indexer_kl.values())
        seq = list(state.balance_loss.values())
        return torch.stack([sum(kl, zero), torch.tensor(float(len(kl)), device=device), sum(seq, zero)])

    def _unpack(self, inputs):
        cfg = self.cfg
        inputs = [from_carrier(t, s.shape, s.dtype) if is_carried(s, self.float_wire) else t
                  for s, t in zip(self._in, inputs)]
        got = dict(zip(((s.name, s.layer) for s in self._in), inputs))
        entries = {(s.name, s.layer): s.entries for s in self._in}
        S, pre, aux = got[("streams", None)], got[("pre", None)], got[("aux", None)]
        # Positions (and the context-parallel chunk) as the whole model has them: without a hasher, new_state
        # reads only the token tensor's shape and device. The whole micro-batch's tokens, not S's: under sequence
        # parallelism S is this tp rank's sequence shard, and attention reads positions of the gathered sequence.
        ids = S.new_empty((S.shape[0], self.seq_len), dtype=torch.int64)
        state, _ = new_state(cfg, ids, self.sequence_shard)
        state.h_mid = got.get(("h_mid", None))
        codes = got[("kv_dtypes", None)].tolist() if ("kv_dtypes", None) in got else None
        kv = [(key, t) for key, t in got.items() if key[0] in KV_SLOTS]
        for i, (key, t) in enumerate(kv):  # back to the dtype the sender's layers made (see boundary_slots)
            got[key] = t.to(self.autocast_dtype) if codes is not None and codes[i] else t
        for (name, layer), t in got.items():
            if name == "kv_main":
                state.kv[layer] = (t, got[("kv_keys", layer)])
            elif name == "topk":
                state.selection[layer] = t if t.dtype == torch.int32 else unpack_bits(t, entries[(name, layer)])
            elif name == "pool":
                state.pool = t if t.dtype == torch.int32 else unpack_bits(t, entries[(name, layer)])
        engram_in = None
        if ("engram_dead", None) in got:  # rows of this stage's Engram layers and of later stages' (passed on)
            dead = got[("engram_dead", None)].bool()
            engram_in = {layer: (t, dead) for (name, layer), t in got.items() if name == "engram_rows"}
        image_mask = got[("image_mask", None)].bool() if ("image_mask", None) in got else None
        return S, pre, state, engram_in, image_mask, aux

    def _pack(self, S, pre, state: ForwardState, engram_in, image_mask, aux) -> tuple[torch.Tensor, ...]:
        out, kv_codes = [], []
        for s in self._out:
            if s.name == "streams":
                t = S
            elif s.name == "pre":
                t = pre
            elif s.name == "h_mid":
                t = state.h_mid
            elif s.name in KV_SLOTS:
                t = state.kv[s.layer][KV_SLOTS.index(s.name)]
                kv_codes.append(int(t.dtype == self.autocast_dtype and t.dtype != s.dtype))
                if kv_codes[-1]:
                    t = t.to(s.dtype)  # exact: the autocast dtype is the narrower one
            elif s.name == "kv_dtypes":
                t = torch.tensor(kv_codes, dtype=torch.uint8, device=S.device)
            elif s.name == "topk":
                t = state.selection[s.layer]
                t = t if s.dtype == torch.int32 else pack_bits(t)
            elif s.name == "pool":
                t = state.pool if s.dtype == torch.int32 else pack_bits(state.pool)
            elif s.name == "engram_rows":
                t = engram_in[s.layer][0]
            elif s.name == "engram_dead":
                t = next(iter(engram_in.values()))[1].to(torch.uint8)
            elif s.name == "image_mask":
                t = image_mask.to(torch.uint8)
            else:
                t = aux
            if tuple(t.shape) != s.shape or t.dtype != s.dtype:
                raise RuntimeError(
                    f"pipeline stage [{self.start}, {self.end}): {s.name}"
                    f"{'' if s.layer is None else f' of layer {s.layer}'} is {tuple(t.shape)} {t.dtype}, the "
                    f"static layout says {s.shape} {s.dtype} (micro-batch shape or act_dtype set wrong?)")
            if is_carried(s, self.float_wire):
                t = to_carrier(t)
            t = t.contiguous()  # gloo sends contiguous tensors only
            if t._is_view() or (t.requires_grad and t.is_leaf):
                # The zero-bubble backward detaches stage outputs in place, which a view refuses and a leaf input
                # must not suffer (forward's Tie alias is neither, but the first stage's outputs are not tied).
                t = t.clone()
            out.append(t)
        return tuple(out)


def split_model(model: Transformer, cuts: Sequence[int], stage_ids: Sequence[int], *,
                image_mask: bool = False) -> list[PipelineStageModule]:
    """This rank's stage modules (stages `stage_ids` of len(cuts) + 1), sharing the model's submodules; drop the
    model afterwards. Works on a meta-built model: apply TP / FSDP plans to each stage module, then `to_empty`
    and `init_weights()` them (or load a checkpoint: the names are the whole model's)."""
    num_layers = model.cfg.num_layers
    bounds = [0, *cuts, num_layers]
    if any(b >= c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"pipeline: cuts must increase strictly inside (0, {num_layers}), got {list(cuts)}")
    for s in stage_ids:
        if not 0 <= s < len(bounds) - 1:
            raise ValueError(f"pipeline: stage {s} does not exist: {len(bounds) - 1} stages from cuts {list(cuts)}")
    return [PipelineStageModule(model, bounds, s, image_mask=image_mask) for s in stage_ids]


# ---------------------------------------------------------------------------------------------------------------------
# Loss and the schedule


class PipelineLoss:
    """The last stage's loss per micro-batch: the LM term of trainer/loss.py's `LMLoss` (the plain path's loss, the
    same code) + coef * mean indexer KL + MoE sequence balance, as the unpipelined trainer adds them. The target is
    the labels [B, T], or labels and per-token weights stacked as float64 [B, T, 2] (`Pipeline.step`: the schedule
    splits one target tensor into micro-batches). Keeps each micro-batch's detached terms for logging."""

    def __init__(self, cfg: ModelConfig):
        self.coef = cfg.indexer.loss_coef
        self.lm = LMLoss()
        self.terms: list[torch.Tensor] = []  # [lm, kl mean (unweighted), seq balance] per micro-batch

    def __call__(self, output, target: torch.Tensor) -> torch.Tensor:
        logits, aux = output
        labels, weights = target, None
        if target.dim() == 3:  # (label, weight) pairs; labels are exact in float64
            labels, weights = target[..., 0].long(), target[..., 1]
        lm = self.lm.lm(logits, labels, weights)
        kl_sum, kl_count, seq = aux.unbind()
        kl = kl_sum / kl_count.clamp_min(1.0)  # no KL term at all without index sources (count 0, sum 0)
        self.terms.append(torch.stack([lm, kl, seq]).detach())
        return lm + (self.coef * kl + seq)


class Pipeline:
    """This rank's stages and the schedule that runs them. step() runs forward and backward of every micro-batch
    of one optimiser step; gradients land (averaged over micro-batches) in the stage modules' .grad."""

    def __init__(self, stages: list[PipelineStageModule], schedule, loss: PipelineLoss, group, image_mask: bool,
                 rows: int, n_microbatches: int):
        self.stages, self.schedule, self.loss, self.group = stages, schedule, loss, group
        self.rows = rows  # M x B rows per step
        self.n_microbatches = n_microbatches
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self.image_mask = image_mask
        self.metrics: dict[str, float] = {}

    def parameters(self):
        for stage in self.stages:
            yield from stage.parameters()

    def state_dict(self) -> dict:
        """This rank's part of the model's state dict, under the whole model's names (disjoint across pp ranks)."""
        return {k: v for stage in self.stages for k, v in stage.state_dict().items()}

    def moe_layers(self) -> list[MoE]:
        return [m for stage in self.stages for m in stage.moe_layers()]

    def step(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
             image_mask: torch.Tensor | None = None, *, weights: torch.Tensor | None = None,
             tokens=None) -> float:
        """input_ids / labels [M*B, T] (input_ids needed where the first stage lives, labels where the last does);
        weights [M*B, T]: per-token loss weights (None: 1); tokens: the step's `trainer.loss.StepTokens` (default:
        this rank's valid labels, no data ranks). Returns the mean loss over the micro-batches (a float, the same on
        every rank of the pipeline group); sets `metrics` (means of lm, unweighted indexer_kl and moe_seq_balance)."""
        for name, t in (("input_ids", input_ids), ("labels", labels)):
            if t is not None and t.shape[0] != self.rows:
                raise ValueError(f"pipeline: {name} has {t.shape[0]} rows, the static micro-batch layout expects "
                                 f"n_microbatches x microbatch_size = {self.rows}")
        args: tuple = ()
        if self.has_first:  # contiguous: torch 2.11's stage checks the micro-batches' strides against its example
            args = (input_ids, image_mask) if self.image_mask else (input_ids,)
            args = tuple(a.contiguous() for a in args)
        self.loss.terms.clear()
        if self.has_last:
            self.loss.lm.begin_step(tokens or StepTokens(valid_tokens(labels), 1, self.n_microbatches))
            if weights is not None:
                labels = torch.stack([labels.double(), weights.double()], dim=-1)
        self.schedule.step(*args, target=labels if self.has_last else None, return_outputs=False)
        device = next(iter(self.stages[0].parameters())).device
        terms = torch.zeros(3, device=device)
        if self.has_last:
            terms = torch.stack(self.loss.terms).mean(0)
        if dist.get_world_size(self.group) > 1:  # exactly one rank holds the last stage; the others add zeros
            dist.all_reduce(terms, group=self.group)
        lm, kl, seq = terms.tolist()
        self.metrics = {"lm": lm, "indexer_kl": kl, "moe_seq_balance": seq}
        return lm + self.loss.coef * kl + seq


PIPELINE_MIN_TORCH = "2.11"


def check_torch_version() -> None:
    """Raise, naming the reason, on a torch older than the PipelineStage versions this module runs on (2.11, whose
    stages get the float wire, and 2.13; the project's own floor, pyproject.toml)."""
    if torch.torch_version.TorchVersion(torch.__version__) < PIPELINE_MIN_TORCH:
        raise RuntimeError(
            f"pipeline parallelism (parallel.pp > 1) needs torch >= {PIPELINE_MIN_TORCH}, this is {torch.__version__}: "
            "trainer/parallel/pipeline.py runs on torch.distributed.pipelining's PipelineStage of torch 2.11 (with "
            "the float wire: the module docstring) and 2.13; older ones are untested")


def build_pipeline(stages: list[PipelineStageModule], pp_group, *, schedule: str, n_microbatches: int,
                   microbatch_size: int, seq_len: int, device: torch.device, act_dtype: torch.dtype | None = None,
                   autocast_dtype: torch.dtype | None = None, context_len: int | None = None,
                   sequence_shards: int = 1) -> Pipeline:
    """Wrap this rank's (materialised) stage modules in PipelineStages with static shapes and build `schedule`
    (a key of SCHEDULES) over `n_microbatches` micro-batches of `microbatch_size` rows x `seq_len` tokens.
    pp_group: the pipeline process group (Meshes.pp.get_group()). autocast_dtype: run every stage under
    torch.autocast (the trainer's bf16 mode); act_dtype, context_len, sequence_shards (tp under sequence
    parallelism): see PipelineStageModule.set_shapes."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    check_torch_version()
    cls, _ = SCHEDULES[schedule]
    pp = dist.get_world_size(pp_group)
    num_stages = len(stages) * pp
    cfg = stages[0].cfg
    pipeline_stages = []
    for module in stages:
        if module.num_stages != num_stages:
            raise ValueError(f"pipeline: stage {module.stage_index} was cut into {module.num_stages} stages, but "
                             f"{len(stages)} stages on each of {pp} ranks make {num_stages}")
        module.set_shapes(microbatch_size, seq_len, act_dtype, autocast_dtype, context_len, sequence_shards)
        stage = ZeroBubbleStage(module, module.stage_index, num_stages, device, input_args=module.example_inputs(),
                                output_args=module.example_outputs(), group=pp_group)
        stage.fill_input_grads = module.float_wire  # torch 2.11 sends a gradient back for every received tensor
        pipeline_stages.append(stage)
    loss = PipelineLoss(cfg)
    if schedule == "1F1B":
        if len(stages) != 1:
            raise ValueError(f"schedule 1F1B runs one stage per rank, this rank has {len(stages)}")
        sched = cls(pipeline_stages[0], n_microbatches=n_microbatches, loss_fn=loss)
    else:
        sched = cls(pipeline_stages, n_microbatches=n_microbatches, loss_fn=loss)
    return Pipeline(stages, sched, loss, pp_group, stages[0].uses_image_mask, n_microbatches * microbatch_size,
                    n_microbatches)
