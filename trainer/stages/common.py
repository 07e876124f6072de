"""What the post-training stages share: their tokenizer and chat template, frozen models (a teacher, RL's reference),
held-out prompts, and the forwards that score sequences without training.

The tokenizer of a post-training run is the one its starting weights were trained with (checkpoint.init_from's run,
trainer/checkpoint/loading.py `run_tokenizer`), else data.path's (prepared as for pretraining). The chat template
(data/chat.py) adds its role and effort markers when the tokenizer lacks them; the model's vocabulary must cover
the result.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from data.chat import ChatTemplate
from data.config import ensure_prepared, tokenizer_path
from data.shards import file_sha256
from data.tokenizer import TokenizerInfo, load_tokenizer, tokenizer_info
from model.config import ModelConfig
from trainer import CONF_DIR
from trainer.checkpoint.hf_io import is_hf_dir
from trainer.checkpoint.loading import find_checkpoint, load_model, model_config, read_marker, run_tokenizer
from trainer.stages.rollout import sequences

log = logging.getLogger(__name__)

__all__ = ["stage_tokenizer", "load_frozen", "token_logprobs", "whole_logits", "tokenizer_sha"]


def tokenizer_sha(path: str) -> str:
    return file_sha256(path)


def stage_tokenizer(cfg, *, progress: bool = False):
    """(ChatTemplate, TokenizerInfo) of a post-training run (see the module docstring)."""
    path = None
    if cfg.checkpoint.init_from:
        hf = Path(cfg.checkpoint.init_from)
        try:
            if is_hf_dir(hf):  # a Hugging Face directory: its own tokenizer.json, when it ships one
                if not (hf / "tokenizer.json").is_file():
                    raise ValueError(f"{hf} has no tokenizer.json")
                path = str(hf / "tokenizer.json")
            else:
                path = run_tokenizer(find_checkpoint(cfg.checkpoint.init_from))
        except ValueError as e:
            log.warning("checkpoint.init_from: %s; using data.path's tokenizer", e)
    if path is None:
        ensure_prepared(cfg.data, progress=progress)
        path = tokenizer_path(cfg.data)
    template = ChatTemplate(load_tokenizer(path))
    base = tokenizer_info(template.tokenizer, path)
    info = TokenizerInfo(path=path, vocab_size=template.vocab_size, eos_id=base.eos_id, bos_id=base.bos_id,
                         pad_id=base.pad_id)
    return template, info


def load_frozen(ref, device: torch.device, tokenizer_path: str, *, what: str, key: str) -> torch.nn.Module:
    """A frozen whole model (a teacher, the RL reference) from a checkpoint, on every rank. ref: a path, or a
    ModelRef (ckpt, model). Refuses, naming `key`, a checkpoint whose run used another tokenizer."""
    from omegaconf import OmegaConf

    ckpt, model_name = (ref, "") if isinstance(ref, (str, Path)) else (ref.ckpt, ref.model)
    try:
        path = find_checkpoint(str(ckpt))
        marker = read_marker(path)
    except ValueError as e:
        raise ValueError(f"{key}: {e}") from None
    chosen = None
    if model_name:
        conf = CONF_DIR / "model" / f"{model_name}.yaml"
        if not conf.is_file():
            raise ValueError(f"{key.rsplit('.', 1)[0]}.model={model_name!r}: no conf/model/{model_name}.yaml")
        node = OmegaConf.load(conf)
        node.pop("defaults", None)
        chosen = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), node))
    cfg = model_config(marker.get("model"), chosen, [], path)
    check_tokenizer(path, tokenizer_path, key=key, what=what,
                    why="its log-probs would score other tokens. Distil from a model of the same tokenizer")
    model = load_model(path, cfg, device, tokenizer_path)
    for p in model.parameters():
        p.requires_grad_(False)
    log.info("%s: %s (%s, %.1fM parameters)", what, path, cfg.name, sum(p.numel() for p in model.parameters()) / 1e6)
    return model


def check_tokenizer(path: Path, tokenizer_path: str, *, key: str, what: str, why: str) -> None:
    """Refuse, naming `key`, checkpoint `path` when its run trained with another tokenizer than `tokenizer_path`
    (another file whose bytes differ; a run whose tokenizer cannot be found is not refused). why: what would go
    wrong, for the message."""
    try:
        theirs = run_tokenizer(path)
    except ValueError:
        return
    if os.path.realpath(theirs) != os.path.realpath(tokenizer_path) and \
            tokenizer_sha(theirs) != tokenizer_sha(tokenizer_path):
        raise ValueError(f"{key}: the {what} {path} was trained with another tokenizer ({theirs}) than this run's "
                         f"({tokenizer_path}): {why}")


def reverse_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(student || teacher) over the last (vocabulary) dimension of two log-softmaxes:
    sum_v p_v (log p_v - log q_v)."""
    return (student_logprobs.exp() * (student_logprobs - teacher_logprobs)).sum(-1)


def whole_logits(logits: torch.Tensor) -> torch.Tensor:
    """Logits as one tensor on this rank (vocab-sharded DTensor logits under tensor parallelism gathered)."""
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


@torch.no_grad()
def token_logprobs(module: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                   routing=None, replay_cuts=None, full: bool = False):
    """A scoring forward of `module` (eval mode: no balancing counts): per position the log-prob of its label
    ([B, T], 0 where the label is ignored), and with full=True the [B, T, V] log-softmax as well."""
    was = module.training
    module.eval()
    try:
        extras = {k: v for k, v in (("routing", routing), ("replay_cuts", replay_cuts)) if v is not None}
        logits = whole_logits(module(input_ids, **extras)).float() / temperature
    finally:
        module.train(was)
    lp = logits.log_softmax(-1)
    valid = labels >= 0
    picked = lp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1) * valid
    return (picked, lp) if full else picked


def completion_logprobs(module: torch.nn.Module, rollouts, device, *, temperature: float = 1.0, pad_id: int = 0,
                        kl_to: torch.nn.Module | None = None):
    """One padded scoring forward of `module` over the rollouts (prompt + completion): per rollout the log-probs of
    its completion tokens (a list). With kl_to (a teacher): instead, per rollout the exact per-position reverse KL
    KL(module || kl_to) over the vocabulary at its completion positions."""
    if not rollouts:
        return []
    ids, labels = _scoring_batch(rollouts, pad_id, device)
    if kl_to is None:
        lp = token_logprobs(module, ids, labels, temperature=temperature)
        return [lp[b, len(r.prompt_ids) - 1:len(r.prompt_ids) - 1 + len(r.token_ids)].cpu().tolist()
                for b, r in enumerate(rollouts)]
    _, s = token_logprobs(module, ids, labels, temperature=temperature, full=True)
    _, t = token_logprobs(kl_to, ids, labels, temperature=temperature, full=True)
    kl = reverse_kl(s, t)  # [B, T]
    return [kl[b, len(r.prompt_ids) - 1:len(r.prompt_ids) - 1 + len(r.token_ids)].cpu().tolist()
            for b, r in enumerate(rollouts)]


def _scoring_batch(rollouts, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(r.prompt_ids) + len(r.token_ids) - 1 for r in rollouts)
    ids, labels = sequences(rollouts, T, pad_id)
    return ids.to(device), labels.to(device)


def completion_distributions(module: torch.nn.Module, rollouts, device, *, temperature: float = 1.0,
                             pad_id: int = 0) -> list[torch.Tensor]:
    """One padded scoring forward of `module` over the rollouts: per rollout the log-softmax at its completion
    positions, [len(token_ids), V] fp32 on the CPU."""
    if not rollouts:
        return []
    ids, labels = _scoring_batch(rollouts, pad_id, device)
    _, lp = token_logprobs(module, ids, labels, temperature=temperature, full=True)
    return [lp[b, len(r.prompt_ids) - 1:len(r.prompt_ids) - 1 + len(r.token_ids)].cpu()
            for b, r in enumerate(rollouts)]
