"""`python -m trainer.cli.evaluate ckpt=<checkpoint or run dir> [corpus=[<path>,...]] [sft_eval=true]`: the loss and
perplexity of a checkpoint's model on text it is given, as one table (conf/evaluate.yaml lists the keys).

Contract: the checkpoint, its model config and tokenizer are found as `generate` finds them
(trainer/checkpoint/loading.py); only the model is read. One row per `corpus` path (prepared shards, or text as
`data.prepare --corpus` takes it, cut into windows as the pretraining loader packs them, at most `max_tokens`
predicted tokens each), one for `sft_eval=true` (the SFT stage's held-out samples: the stage's `eval/loss`); with
neither, the run's own `data.path`, marked as the training data. Loss: mean cross-entropy in nats per predicted
token; perplexity exp(loss).

Exit status 0, or 2 with one `error: ...` line for a bad key, a missing or corrupt checkpoint, corpus or tokenizer.

Design and reasoning: docs/training.md#evaluating-a-checkpoint
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from config_checks import at_least, check_choices, choice_field
from data.chat import ChatTemplate
from data.prepare import Corpus
from data.sft import SFTLoader
from data.shards import META_NAME, ShardError, file_sha256, read_meta, read_shard
from data.tokenizer import load_tokenizer, tokenizer_info
from trainer.checkpoint.loading import find_checkpoint, load_model, model_config, read_marker, run_tokenizer
from trainer.cli.app import device_named, run_app
from trainer.compose import compose
from trainer.config import Config, register_configs, to_config
from trainer.stages.sft import SFT
from trainer.threads import ThreadChoice, contention_hint, set_cpu_threads


@dataclass
class EvaluateConfig:
    ckpt: str = ""
    """<run dir>/checkpoints/step_<N>, or a run directory (its newest complete checkpoint)"""
    corpus: List[str] = field(default_factory=list)
    """paths to score: prepared shards, a text file, a .jsonl of {"text": ...}, a directory of text files"""
    sft_eval: bool = False
    """also score the SFT stage's held-out samples (assistant tokens)"""
    tokenizer: str = ""
    """a tokenizer.json; "" = the training run's (its .hydra/config.yaml)"""
    seq_len: int = 0
    """tokens a window predicts; 0 = the run's data.seq_len (128 outside a run directory)"""
    batch_size: int = 0
    """windows a forward scores; 0 = the run's data.batch_size (8 outside a run directory)"""
    max_tokens: int = 65536
    """at most this many predicted tokens per corpus path (0 = all of it)"""
    device: str = choice_field("auto", ("auto", "cpu", "cuda"))
    """auto: cuda when available, else cpu"""
    num_threads: int = 0
    """CPU threads; 0 = the cores this process may use (trainer/threads.py)"""

    def __post_init__(self) -> None:
        check_choices(self, "evaluate")
        for key in ("seq_len", "batch_size", "max_tokens", "num_threads"):
            at_least(key, getattr(self, key), 0)
        if not self.ckpt:
            raise ValueError("ckpt= is required: python -m trainer.cli.evaluate ckpt=<checkpoint or run dir>")


@dataclass
class Row:
    """One line of the table: what was scored, the tokens predicted, their mean cross-entropy in nats."""

    what: str
    tokens: int
    loss: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf


# -- what the run recorded ---------------------------------------------------------------------------------------------
def run_config(ckpt: Path) -> tuple[Config | None, Path | None]:
    """(the training run's typed config, the directory it was launched from) of checkpoint `ckpt`, from the run's
    .hydra/ files; (None, None) for a checkpoint outside a run directory."""
    run_dir = ckpt.parent.parent
    config, hydra = run_dir / ".hydra" / "config.yaml", run_dir / ".hydra" / "hydra.yaml"
    if ckpt.parent.name != "checkpoints" or not config.is_file():
        return None, None
    register_configs()
    try:
        cfg = to_config(OmegaConf.load(config))
        launch_dir = Path(OmegaConf.load(hydra).hydra.runtime.cwd) if hydra.is_file() else run_dir
    except Exception as e:  # a hand-edited or older config: OmegaConf raises several kinds
        raise ValueError(f"cannot read the run's config {config}: {str(e).splitlines()[0] if str(e) else e}") from None
    return cfg, launch_dir


# -- corpora -----------------------------------------------------------------------------------------------------------
def _shard_documents(path: Path, tokenizer_path: str) -> Iterator[np.ndarray]:
    meta, shards = read_meta(str(path))
    made_with = meta.get("tokenizer_sha256")
    if made_with and made_with != file_sha256(tokenizer_path):
        raise ValueError(f"corpus {path} was prepared with another tokenizer than the model's ({tokenizer_path}): "
                         f"prepare it with `python -m data.prepare --corpus <text> --out <dir> --tokenizer "
                         f"{tokenizer_path}`")
    for info in shards:
        try:
            yield from read_shard(str(path / info.name), info, meta["ids_dtype"])
        except ShardError as e:
            raise ValueError(f"corpus {path}: shard {info.name}: {e}") from None


def documents(path: Path, tokenizer, tokenizer_path: str) -> Iterator[np.ndarray]:
    """The token ids of each document at `path` (see the module docstring for what a path may be)."""
    if not path.exists():
        raise ValueError(f"corpus {path}: no such file or directory")
    if (path / META_NAME).is_file():
        yield from _shard_documents(path, tokenizer_path)
        return
    try:
        texts = Corpus(str(path)).texts()  # the documents data.prepare would make of it, in its order
        for text in texts:
            yield np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)
    except ValueError as e:  # DataConfigError names data.corpus: here the path is the corpus
        raise ValueError(f"corpus {path}: {str(e).replace(f'data.corpus={os.path.abspath(path)!r}', 'it')}") from None


def windows(docs: Iterator[np.ndarray], eos_id: int, seq_len: int, max_tokens: int) -> torch.Tensor:
    """[N, seq_len + 1] windows every seq_len tokens over the documents, each ended with <eos> (the pretraining
    loader's packing), enough for max_tokens predicted tokens (0: all); a stream shorter than one window is one
    shorter window."""
    need = max_tokens + 1 if max_tokens else None
    parts, have = [], 0
    for doc in docs:
        parts += [np.asarray(doc, dtype=np.int64), np.array([eos_id], dtype=np.int64)]
        have += len(doc) + 1
        if need is not None and have >= need:
            break
    stream = torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, dtype=torch.long)
    if need is not None:
        stream = stream[:need]
    if len(stream) < 2:
        raise ValueError("holds fewer than 2 tokens")
    if len(stream) < seq_len + 1:
        return stream[None]
    count = (len(stream) - 1) // seq_len
    return stream[: count * seq_len + 1].unfold(0, seq_len + 1, seq_len)


# -- scoring -----------------------------------------------------------------------------------------------------------
@torch.no_grad()
def score(model: torch.nn.Module, batches, device: torch.device) -> tuple[float, int]:
    """(the summed cross-entropy, the tokens scored) of `batches` of (input_ids, labels) [B, T], labels -100 where
    nothing is predicted."""
    total, count = 0.0, 0
    autocast = device.type == "cuda"
    for ids, labels in batches:
        ids, labels = ids.to(device), labels.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids)
        logits = (logits.full_tensor() if hasattr(logits, "full_tensor") else logits).float()
        total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                         reduction="sum"))
        count += int((labels != -100).sum())
    return total, count


def _corpus_batches(w: torch.Tensor, batch_size: int):
    for i in range(0, len(w), batch_size):
        chunk = w[i:i + batch_size]
        yield chunk[:, :-1], chunk[:, 1:]


def sft_batches(run_cfg: Config | None, tokenizer, seq_len: int, batch_size: int) -> tuple[list, str, int]:
    """(the SFT stage's held-out batches, the row's name, the chat template's vocabulary size): one pass over its
    held-out samples, batched as the stage batches them in one process (trainer/stages/sft.py)."""
    if run_cfg is not None and run_cfg.stage.name == "sft":
        cfg, where = run_cfg, "the run's"
    else:
        register_configs()
        base = to_config(compose(["stage=sft"]))
        cfg = dataclasses.replace(run_cfg, stage=base.stage) if run_cfg is not None else base
        where = "conf/stage/sft.yaml's"
    template = ChatTemplate(tokenizer)
    stage = SFT(cfg.stage)
    _, held = stage.samples(cfg, template)
    fixed = cfg.stage.fixed_length or cfg.parallel.pp > 1 or cfg.parallel.cp > 1
    loader = SFTLoader(held, template, seed=0, seq_len=seq_len, batch_size=batch_size, fixed_length=fixed,
                       bucket_size=cfg.stage.bucket_size * batch_size)
    n = max(1, len(held) // batch_size)  # one pass over the held-out samples, as the stage scores them
    batches = [(b["input_ids"], b["labels"]) for _, b in zip(range(n), iter(loader))]
    return batches, f"sft held-out ({len(held)} samples, {where} settings)", template.vocab_size


def evaluate(cfg: EvaluateConfig) -> list[Row]:
    """Everything the command does once its config is composed: loads the model, scores each set, prints the table."""
    path = find_checkpoint(cfg.ckpt)
    marker = read_marker(path)
    model_cfg = model_config(marker.get("model"), None, [], path)
    run_cfg, launch_dir = run_config(path)
    tokenizer_path = cfg.tokenizer or run_tokenizer(path)
    tokenizer = load_tokenizer(tokenizer_path)
    info = tokenizer_info(tokenizer, tokenizer_path)
    if info.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"tokenizer {tokenizer_path} has {info.vocab_size} ids, more than the checkpoint's "
                         f"model.vocab_size={model_cfg.vocab_size}: give the tokenizer it was trained with")
    seq_len = cfg.seq_len or (run_cfg.data.seq_len if run_cfg else 128)
    batch_size = cfg.batch_size or (run_cfg.data.batch_size if run_cfg else 8)
    corpora = [(Path(p), str(p)) for p in cfg.corpus]
    if not corpora and not cfg.sft_eval:
        if run_cfg is None:
            raise ValueError(f"checkpoint {path} is not in a run directory: give corpus=[<path>] or sft_eval=true")
        data = launch_dir / run_cfg.data.path
        corpora = [(data, f"{run_cfg.data.path} (the run's training data, not held out)")]
    sets = []  # (name, batches): every input read and checked before the model is built
    for p, name in corpora:
        try:
            w = windows(documents(p, tokenizer, tokenizer_path), info.eos_id, seq_len, cfg.max_tokens)
        except ValueError as e:
            raise ValueError(str(e) if str(e).startswith("corpus") else f"corpus {p}: {e}") from None
        sets.append((name, list(_corpus_batches(w, batch_size))))
    if cfg.sft_eval:
        batches, name, vocab = sft_batches(run_cfg, tokenizer, seq_len, batch_size)
        if vocab > model_cfg.vocab_size:
            raise ValueError(f"sft_eval: the chat template's {vocab} ids exceed the checkpoint's model.vocab_size="
                             f"{model_cfg.vocab_size}")
        sets.append((name, batches))
    device = device_named(cfg.device)
    threads = set_cpu_threads(cfg.num_threads) if device.type == "cpu" else None
    if threads and (hint := contention_hint(threads, "num_threads")):
        print(f"warning: {hint}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    model = load_model(path, model_cfg, device, tokenizer_path)
    rows = []
    for name, batches in sets:
        # a terminal sees the scoring advance (minutes for a large corpus on a CPU); a log or a pipe gets the table only
        shown = tqdm(batches, desc=f"scoring {name}", unit="batch", leave=False, disable=not sys.stderr.isatty())
        total, count = score(model, shown, device)
        rows.append(Row(name, count, total / max(count, 1)))
    print(report(path, marker, rows, threads, time.perf_counter() - start), flush=True)
    return rows


def report(path: Path, marker: dict, rows: list[Row], threads: ThreadChoice | None, seconds: float) -> str:
    """The table: a line naming the checkpoint, then one row per set (tokens, loss in nats, perplexity)."""
    name = (marker.get("model") or {}).get("name", "?")
    head = (f"checkpoint {path} (model {name}, step {marker.get('step', '?')}): loaded and scored in {seconds:.1f} s"
            + (f"; CPU {threads.describe()}" if threads else ""))
    table = [("set", "tokens", "loss", "perplexity")] + [
        (r.what, f"{r.tokens:,}", f"{r.loss:.4f}", f"{r.perplexity:.2f}") for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(4)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(t, widths))).rstrip()
             for t in table]
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None) -> None:
    before = torch.get_num_threads()
    try:
        run_app("evaluate", EvaluateConfig, evaluate, argv, __doc__)
    finally:
        torch.set_num_threads(before)  # a caller in the same process (a test) keeps its own


if __name__ == "__main__":
    main()
