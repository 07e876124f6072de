"""DSpark drafter training (`stage=dspark`; SPEC 1.6 and 4, REFERENCE B6): the drafter (model/dspark.py) learns the
frozen backbone's own next-token distributions on the training data.

Contract: `DSparkStage` builds the drafter alone as the job's module (the optimiser, gradient reduction, balancing
and checkpoints see only it); the backbone is loaded whole on every rank from checkpoint.init_from, frozen, and
recorded in each checkpoint's marker (`load_drafter` reads both back for the engine). Per micro-batch it draws
`stage.anchors` anchors per row (`sample_anchors`, seeded by run seed, step and micro-batch: layout- and
resume-independent) and scores every slot against the backbone's distribution (`block_targets`, DeepSpec's
`draft_loss` normalised over the global batch). Held-out rows give `acceptance_len` and `predicted_acceptance_len`.
Layouts: data parallelism only (tp, pp, cp, ep refused).

Design and reasoning: docs/stages.md#dspark-drafter-training
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

import model as model_pkg
from data.config import build_dataloader, ensure_prepared
from model.accounting import dspark_parameters
from model.dspark import DSpark, acceptance_length, draft_loss, drafter_config, stream_means
from trainer.batch import compute_device
from trainer.checkpoint.hf_io import is_hf_dir
from trainer.checkpoint.loading import (
    find_checkpoint,
    load_model,
    model_config,
    read_marker,
    read_model_state,
    run_tokenizer,
)
from trainer.engine import Engine, Request, SamplingParams
from trainer.loss import IGNORE_INDEX, LMLoss
from trainer.parallel.gradients import sum_over_data
from trainer.stages.base import Stage
from trainer.stages.common import check_tokenizer
from trainer.train import MicroBatches

log = logging.getLogger(__name__)

__all__ = ["DSparkStage", "DraftObjective", "sample_anchors", "block_targets", "load_backbone", "load_drafter",
           "load_drafter_weights"]


class DraftObjective(LMLoss):
    """The stage's loss object: the trainer's step normalisation hook (`begin_step`) and the loss's coefficients;
    the drafter's loss itself is computed in `DSparkStage.forward_backward` from logits the LM loss never sees."""

    supports_fused = False

    def __init__(self, ce: float, l1: float, conf: float, gamma: float) -> None:
        super().__init__()
        self.ce, self.l1, self.conf, self.gamma = ce, l1, conf, gamma


def sample_anchors(labels: torch.Tensor, count: int, block: int, generator: torch.Generator, *,
                   whole_block: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [B, T] -> (anchors [B, A] positions, ok [B, A] bool), A = min(count, T): per row, A positions drawn
    uniformly without replacement among those whose next token counts (labels[a] != IGNORE_INDEX), or with
    whole_block those whose next `block` tokens all exist and count. A row with fewer such positions gets its
    others with ok False (they weigh nothing)."""
    B, T = labels.shape
    counts = labels != IGNORE_INDEX
    if whole_block:
        if T < block:
            eligible = torch.zeros_like(counts)
        else:  # a + block - 1 <= T - 1 and every label of the block counts
            run = counts.int().unfold(1, block, 1).prod(-1).bool()  # [B, T - block + 1]
            eligible = torch.cat((run, torch.zeros(B, block - 1, dtype=torch.bool, device=labels.device)), dim=1)
    else:
        eligible = counts
    keys = torch.rand(B, T, generator=generator).to(labels.device)
    keys = torch.where(eligible, keys, torch.full_like(keys, -1.0))
    A = min(count, T)
    top, anchors = keys.topk(A, dim=1)
    return anchors, top >= 0


def block_targets(input_ids: torch.Tensor, labels: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor,
                  ok: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What each anchor's slots are scored against. input_ids, labels [B, T]; logits [B, T, V] the backbone's;
    anchors, ok [B, A]. Returns (targets [B, A, K] the token slot k drafts (labels[a + k]), valid [B, A, K] the
    contiguous prefix of slots whose target exists and counts, prev [B, A, K] the token before each target
    (input_ids[a + k]: the Markov head's input), target_logits [B, A, K, V] the backbone's logits at a + k)."""
    B, T = input_ids.shape
    pos = anchors[..., None] + torch.arange(block, device=anchors.device)  # [B, A, K]
    inside = pos < T
    flat = pos.clamp_max(T - 1).flatten(1)  # [B, A * K]
    targets = labels.gather(1, flat).view_as(pos)
    valid = (inside & (targets != IGNORE_INDEX) & ok[..., None]).int().cumprod(-1).bool()
    prev = input_ids.gather(1, flat).view_as(pos)
    V = logits.shape[-1]
    target_logits = logits.gather(1, flat[..., None].expand(-1, -1, V)).view(*pos.shape, V)
    return targets, valid, prev, target_logits


def load_backbone(ckpt: str, model_cfg, device: torch.device, tokenizer_path: str | None, *, key: str):
    """(the frozen backbone in eval mode, its checkpoint path). The checkpoint must hold `model_cfg`'s parameters
    (keys that change no parameter, e.g. the stage's fake-quant hooks, may differ: `model_cfg` is what runs), and
    with `tokenizer_path` have been trained with that tokenizer."""
    if is_hf_dir(Path(ckpt)):
        raise ValueError(f"{key}={ckpt} is a Hugging Face directory: import it first (python -m "
                         "trainer.cli.import_hf) and give the checkpoint it writes")
    try:
        path = find_checkpoint(ckpt)
        marker = read_marker(path)
        model_config(marker.get("model"), model_cfg, [], path)  # refuses another model, naming the keys
    except ValueError as e:
        raise ValueError(f"{key}: {e}".replace("ckpt=", "")) from None
    if marker.get("stage") == "dspark":
        raise ValueError(f"{key}={ckpt}: {path} is a drafter's checkpoint (stage dspark), not a backbone's")
    if tokenizer_path is not None:
        check_tokenizer(path, tokenizer_path, key=key, what="backbone",
                        why="the drafter would learn its distributions on other ids")
    backbone = load_model(path, model_cfg, device, tokenizer_path or _tokenizer_or_none(path))
    for p in backbone.parameters():
        p.requires_grad_(False)
    return backbone.eval(), path


def _tokenizer_or_none(path: Path) -> str | None:
    try:
        return run_tokenizer(path)
    except ValueError:
        return None


def load_drafter(ckpt: str, device: torch.device, *, backbone: str | None = None):
    """A DSpark run's checkpoint (or run directory: its newest) in this process for generation -> (the backbone,
    the drafter), both in eval mode. The backbone is the checkpoint the drafter was trained on (its marker's
    `backbone`), or `backbone` (a checkpoint of the same model, e.g. one moved elsewhere)."""
    path = find_checkpoint(ckpt)
    marker = read_marker(path)
    _check_drafter_marker(path, marker)
    cfg = model_config(marker.get("model"), None, [], path)
    source = backbone or marker.get("backbone")
    if not source:
        raise ValueError(f"drafter {path}: its marker names no backbone; give the backbone's checkpoint")
    model, _ = load_backbone(source, cfg, device, None, key="backbone")
    return model, load_drafter_weights(path, cfg, device)


def _check_drafter_marker(path: Path, marker: dict) -> None:
    if marker.get("stage") != "dspark":
        raise ValueError(f"drafter {path}: a checkpoint of stage {marker.get('stage')!r}, not a DSpark run's "
                         "(stage=dspark)")


def load_drafter_weights(ckpt, model_cfg, device: torch.device):
    """The drafter of a DSpark run's checkpoint (or run directory) for a backbone of `model_cfg` (the checkpoint must
    have been trained on that model: keys that change no parameter may differ), in eval mode."""
    path = find_checkpoint(str(ckpt))
    marker = read_marker(path)
    _check_drafter_marker(path, marker)
    model_config(marker.get("model"), model_cfg, [], path)  # refuses a drafter of another model, naming the keys
    drafter = DSpark(model_cfg).to(device)
    read_model_state(path, drafter, f"model {model_cfg.name!r}'s drafter")
    for p in drafter.parameters():
        p.requires_grad_(False)
    return drafter.eval()


class DSparkStage(Stage):
    """`stage=dspark` (see docs/stages.md#dspark-drafter-training)."""

    name = "dspark"
    progress_keys = ("acceptance_len",)
    reads_init_from = True  # checkpoint.init_from is the frozen backbone, not the trained module's starting weights

    def __init__(self, stage) -> None:
        self.stage = stage
        self.backbone = None
        self.job = None
        self.tokenizer_path: str | None = None

    # -- the set-up ----------------------------------------------------------------------------------------------------
    def check(self, cfg) -> None:
        if not cfg.checkpoint.init_from:
            raise ValueError("stage=dspark trains the drafter of a frozen backbone: set checkpoint.init_from=<the "
                             "backbone's checkpoint or run directory>")
        if is_hf_dir(Path(cfg.checkpoint.init_from)):
            raise ValueError(f"checkpoint.init_from={cfg.checkpoint.init_from} is a Hugging Face directory: import it "
                             "first (python -m trainer.cli.import_hf) and give the checkpoint it writes")
        drafter_config(cfg.model)  # the model has a drafter (model.dspark.target_layers), named otherwise
        s = self.stage
        if s.heldout_rows >= cfg.data.batch_size:
            raise ValueError(f"stage.heldout_rows={s.heldout_rows} leaves no training row of "
                             f"data.batch_size={cfg.data.batch_size}")
        if s.generated_rows > cfg.data.batch_size - s.heldout_rows:
            raise ValueError(f"stage.generated_rows={s.generated_rows} exceeds the training rows of a micro-batch "
                             f"(data.batch_size={cfg.data.batch_size} - stage.heldout_rows={s.heldout_rows})")
        if s.generated_rows and s.generation_prefix >= cfg.data.seq_len:
            raise ValueError(f"stage.generation_prefix={s.generation_prefix} leaves nothing to generate in "
                             f"data.seq_len={cfg.data.seq_len}")
        if cfg.checkpoint.init_optimizer:
            raise ValueError("checkpoint.init_optimizer=true: stage=dspark's init_from is the backbone, whose "
                             "optimiser owns no drafter parameter; set checkpoint.init_optimizer=false")
        if cfg.trainer.compile:
            raise ValueError("trainer.compile=true: the drafter's blocks are not compiled yet; set "
                             "trainer.compile=false")

    def check_layout(self, parallel) -> None:
        for key in ("tp", "pp", "cp", "ep"):
            if getattr(parallel, key) > 1:
                raise ValueError("stage=dspark runs under data parallelism (parallel.dp_replicate, parallel.dp_shard): "
                                 f"parallel.{key}={getattr(parallel, key)} is not wired for the drafter (the backbone "
                                 "is whole on every rank)")

    def build_module(self, cfg):
        return DSpark(cfg)

    def batches(self, cfg, data_rank: int, data_ranks: int, *, progress: bool = False):
        ensure_prepared(cfg.data, progress=progress)
        loader, tokenizer = build_dataloader(cfg.data, data_rank, data_ranks)
        self.tokenizer_path = tokenizer.path
        return loader, tokenizer

    def loss(self) -> DraftObjective:
        s = self.stage
        return DraftObjective(s.ce_coef, s.l1_coef, s.conf_coef, s.gamma)

    def trainable_parameters(self, module: torch.nn.Module, cfg) -> list[torch.nn.Parameter]:
        return list(module.parameters())

    def callbacks(self) -> list:
        return []

    def bind(self, job) -> None:
        self.job = job
        cfg = job.pm.cfg
        init_from = job.checkpointer.info["init_from"]
        self.backbone, path = load_backbone(init_from, cfg, compute_device(job.pm), self.tokenizer_path,
                                            key="checkpoint.init_from")
        self.data_rank = job.pm.meshes.data.get_local_rank() if job.pm.meshes is not None else 0
        log.info("dspark: backbone %s (%s, %.1fM parameters frozen); drafter %.1fM parameters", path, cfg.name,
                 sum(p.numel() for p in self.backbone.parameters()) / 1e6,
                 sum(p.numel() for p in job.pm.module.parameters()) / 1e6)

    def flops_per_token(self, cfg):
        """seq_len -> FLOPs per token of a step: the backbone's forward (a third of its training FLOPs), the context
        projection at every position, and per drafted slot (anchors x block_size over seq_len a token) the
        drafter's active parameters and the head, forward and backward."""
        with torch.device("meta"):
            backbone = model_pkg.build(cfg)
        drafter = dspark_parameters(cfg)["params_dspark_active"] + backbone.head.weight.numel()
        context = len(cfg.dspark.target_layers) * cfg.dim * cfg.dim
        slots = self.stage.anchors * cfg.dspark.block_size

        def flops(seq_len: int) -> float:
            return (backbone.flops_per_token(seq_len) / 3 + 6.0 * context
                    + 6.0 * drafter * min(slots, seq_len * cfg.dspark.block_size) / seq_len)

        return flops

    # -- one step --------------------------------------------------------------------------------------------------
    def generated_batch(self, ids: torch.Tensor, labels: torch.Tensor, step: int, index: int):
        """The micro-batch (input_ids, labels [B, T], on the CPU) with its first `stage.generated_rows` rows replaced:
        each keeps its first `generation_prefix` tokens and continues with the backbone's own sampled tokens to
        T + 1 tokens (stop tokens ignored: the text runs on as a packed row does), every label counting."""
        s = self.stage
        B, T = ids.shape
        P = s.generation_prefix
        engine = Engine(self.backbone, max_batch=s.generated_rows, max_len=T + 1, replay="none")
        seed = (self.job.trainer.seed * 1_000_003 + step * 10_007 + index) % 2**31
        requests = [Request(ids[b, :P].tolist(), SamplingParams(temperature=s.generation_temperature,
                                                               max_new_tokens=T + 1 - P, seed=seed * 64 + b))
                    for b in range(s.generated_rows)]
        ids, labels = ids.clone(), labels.clone()
        for b, done in enumerate(engine.generate(requests)):
            if done.error:
                raise RuntimeError(f"stage.generated_rows: {done.error}")
            row = torch.tensor(done.prompt_ids + done.token_ids)
            ids[b], labels[b] = row[:T], row[1:T + 1]
        return ids, labels

    def _generator(self, step: int, micro: int) -> torch.Generator:
        """The anchors' generator of the step's micro-batch `micro` of the global batch (data rank r's m-th is
        r x grad_accum + m: a layout that deals the same micro-batches out draws the same anchors)."""
        return torch.Generator().manual_seed((self.job.trainer.seed * 1_000_003 + step * 10_007 + micro) % 2**63)

    def forward_backward(self, pm, batches: list[dict], autocast_dtype, loss: DraftObjective):
        """The trainer's forward and backward over this data rank's micro-batches (trainer/train.py
        `compute_gradients`), for the drafter: see docs/stages.md#dspark-drafter-training. Returns MicroBatches whose
        aux carries the step's figures (averaged over data ranks by the trainer)."""
        s, cfg, drafter = self.stage, pm.cfg, pm.module
        K, device = cfg.dspark.block_size, compute_device(pm)
        step = self.job.state.step + 1
        autocast = lambda: torch.autocast(device.type, dtype=autocast_dtype or torch.float32,  # noqa: E731
                                          enabled=autocast_dtype is not None)
        gamma_w = torch.exp(-torch.arange(K, device=device, dtype=torch.float32) / s.gamma)
        prepared, weight = [], 0.0
        for m, batch in enumerate(batches):
            index = self.data_rank * len(batches) + m  # in the global batch
            ids, labels = batch["input_ids"], batch["labels"]
            if s.generated_rows:
                ids, labels = self.generated_batch(ids, labels, step, index)
            ids, labels = ids.to(device), labels.to(device)
            with torch.no_grad(), autocast(), stream_means(self.backbone, cfg.dspark.target_layers) as means:
                logits = self.backbone(ids)
            means = dict(means)
            held = s.heldout_rows
            g = self._generator(step, index)
            train_a, train_ok = sample_anchors(labels[:len(ids) - held], s.anchors, K, g, whole_block=False)
            anchors, ok = train_a, train_ok
            if held:
                eval_a, eval_ok = sample_anchors(labels[len(ids) - held:], s.anchors, K, g, whole_block=True)
                width = max(train_a.shape[1], eval_a.shape[1])
                pad = lambda a, o: (torch.nn.functional.pad(a, (0, width - a.shape[1])),  # noqa: E731
                                    torch.nn.functional.pad(o, (0, width - o.shape[1])))
                (train_a, train_ok), (eval_a, eval_ok) = pad(train_a, train_ok), pad(eval_a, eval_ok)
                anchors, ok = torch.cat((train_a, eval_a)), torch.cat((train_ok, eval_ok))
            targets, valid, prev, target_logits = block_targets(ids, labels, logits, anchors, ok, K)
            del logits
            trained = (torch.arange(len(ids), device=device) < len(ids) - held)[:, None].expand_as(anchors)
            weight += float((valid.float() * trained[..., None] * gamma_w).sum())
            prepared.append((ids, means, anchors, targets, valid, trained, prev, target_logits))
        (total_weight,) = sum_over_data(pm, [weight])
        share = pm.dims.data * len(batches) / max(total_weight, 1e-9)  # gradient means over ranks, micro-batches
        accum = len(batches)
        loss_sum, tokens = 0.0, 0
        sums = {k: 0.0 for k in ("ce", "l1", "conf", "w", "tau", "tau_pred", "n_eval", "tau_train", "n_train")}
        for ids, means, anchors, targets, valid, trained, prev, target_logits in prepared:
            tokens += ids.numel()
            at = ids.gather(1, anchors)
            with autocast():
                out = drafter(self.backbone.embed, self.backbone.head, means, anchors, at, prev)
            dl = draft_loss(out, target_logits, targets, valid, ce=loss.ce, l1=loss.l1, conf=loss.conf,
                            gamma=loss.gamma, trained=trained)
            total = loss.ce * dl.terms["ce"] + loss.l1 * dl.terms["l1"] + loss.conf * dl.terms["conf"]
            term = total * share
            (term / accum).backward()
            loss_sum += float(term.detach()) / accum
            for k in ("ce", "l1", "conf"):
                sums[k] += float(dl.terms[k].detach())
            sums["w"] += float(dl.weight)
            whole = valid.all(-1)  # [B, A]: anchors whose whole block exists (the figures count those alone)
            is_eval, is_train = ~trained & whole, trained & whole
            tau, tau_pred = acceptance_length(dl.alpha), acceptance_length(dl.predicted)
            sums["tau"] += float(tau[is_eval].sum())
            sums["tau_pred"] += float(tau_pred[is_eval].sum())
            sums["n_eval"] += float(is_eval.sum())
            sums["tau_train"] += float(tau[is_train].sum())
            sums["n_train"] += float(is_train.sum())
        names = sorted(sums)
        totals = dict(zip(names, sum_over_data(pm, [sums[n] for n in names])))
        # global ratios, the same on every rank (the trainer's mean over data ranks leaves them as they are)
        ratio = lambda a, b: totals[a] / totals[b] if totals[b] else math.nan  # noqa: E731
        aux = {f"dspark/{k}": ratio(k, "w") for k in ("ce", "l1", "conf")}
        aux["acceptance_len"] = ratio("tau", "n_eval")
        aux["predicted_acceptance_len"] = ratio("tau_pred", "n_eval")
        aux["dspark/train_acceptance_len"] = ratio("tau_train", "n_train")
        return MicroBatches(loss_sum, aux, tokens, prepared[0][0].shape[1])

