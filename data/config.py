"""The data config (`DataConfig`, the schema of the `data` config group, defined in data/schema.py and imported from
here) and the two entry points the trainer calls.

`ensure_prepared(cfg)` makes sure shards exist (preparing the configured corpus when allowed) and that they were
prepared from what the config asks for; `build_dataloader(cfg, rank, world_size)` returns the packed loader and
what the model needs to know about the tokenizer. Everything else about data lives in data/prepare.py (writing)
and data/loader.py (reading).

Errors about the config are DataConfigError (a ValueError: the trainer prints it as one `error: ...` line) naming
the data.* key; a missing path is DataNotFoundError, which is also a FileNotFoundError.
"""

from __future__ import annotations

import os
import re
import shlex

from data.prepare import check_sources, prepare, prepare_once, resolve_glob, stdlib_dir, tokenizer_file_sha256
from data.schema import DataConfig
from data.shards import META_NAME, DataConfigError, file_sha256, read_meta
from data.tokenizer import BOS, EOS, PAD, SPECIAL_TOKENS, TokenizerInfo, load_tokenizer, tokenizer_info

__all__ = ["DataConfig", "build_dataloader", "check_provenance", "ensure_prepared", "prepare_command"]


def prepare_command(cfg: DataConfig) -> str:
    """The `python -m data.prepare` line that prepares what `cfg` asks for (options left at their defaults omitted:
    the CLI's defaults are DataConfig's)."""
    d = DataConfig()
    args = ["python", "-m", "data.prepare"]
    if cfg.corpus:
        args += ["--corpus", cfg.corpus]
    args += ["--out", cfg.path]
    if cfg.corpus_glob:
        args += ["--glob", cfg.corpus_glob]
    if cfg.tokenizer:
        args += ["--tokenizer", cfg.tokenizer]
    elif cfg.vocab_size != d.vocab_size:
        args += ["--vocab-size", str(cfg.vocab_size)]
    if not cfg.corpus:  # caps apply to the stdlib corpus only
        for key in ("max_files", "max_bytes"):
            if getattr(cfg, key) != getattr(d, key):
                args += [f"--{key.replace('_', '-')}", str(getattr(cfg, key))]
    if cfg.shard_size != d.shard_size:
        args += ["--shard-size", str(cfg.shard_size)]
    return shlex.join(args)


def ensure_prepared(cfg: DataConfig, progress: bool = True) -> str:
    """Make sure `cfg.path` holds shards prepared from what `cfg` asks for; returns the path.

    Without them: prepares `cfg.corpus` when `cfg.auto_prepare`, else raises DataNotFoundError naming data.path and
    the command to run. Safe to call from every rank of every node at once, also on NFS / Lustre where flock is
    not to be trusted: one process prepares while the others wait for its meta.json (data/prepare.py,
    `prepare_once`). Shards prepared from something else are refused (`check_provenance`).
    """
    if not os.path.isfile(os.path.join(cfg.path, META_NAME)):
        if not cfg.auto_prepare:
            read_meta(cfg.path, prepare_command(cfg))  # raises, naming data.path and the command
        check_sources(cfg.corpus, cfg.tokenizer)  # a typo fails here, naming its key, before data.path is created
        default = not cfg.corpus
        prepare_once(
            cfg.path,
            lambda: prepare(
                cfg.path, cfg.corpus, tokenizer=cfg.tokenizer, vocab_size=cfg.vocab_size, glob=cfg.corpus_glob,
                max_files=cfg.max_files if default else 0, max_bytes=cfg.max_bytes if default else 0,
                shard_size=cfg.shard_size, progress=progress,
            ),
            timeout_s=cfg.prepare_timeout_s,
        )
    meta, _ = read_meta(cfg.path)
    check_provenance(cfg, meta)
    return cfg.path


_TRAINED = re.compile(r"trained \(byte-level BPE, (\d+)\)")  # meta.json's tokenizer_source for a trained BPE


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def check_provenance(cfg: DataConfig, meta: dict) -> None:
    """Refuse shards at `cfg.path` (their meta.json `meta`) prepared from something other than `cfg` asks for.

    Compared: the corpus; the glob applied (directory corpora); the tokenizer (data.tokenizer by sha256, or with
    data.tokenizer empty a BPE trained to data.vocab_size with this build's special tokens, a trained BPE recorded
    without them counting as one of <bos>, <eos>, <pad> only); the stdlib caps data.max_files / data.max_bytes. Not
    compared: data.shard_size (it groups the same ids differently). Only what meta.json records is compared, so
    shards of older builds (without the `requested` section) still load when what they do record agrees.
    Raises one DataConfigError line naming data.path, what the shards hold, and the keys that disagree.
    """
    req = meta.get("requested") or {}
    source = meta.get("source")
    made_default = req["corpus"] == "" if "corpus" in req else source is not None and _same_path(source, stdlib_dir())
    want_default = not cfg.corpus
    want_source = os.path.abspath(cfg.corpus) if cfg.corpus else stdlib_dir()

    wrong: list[tuple[str, object, str]] = []  # (key, configured value, a note where the value alone misleads)
    use: list[tuple[str, object]] = []  # (key, value) that would make the config fit these shards
    if source is not None and not (want_default and made_default) and not _same_path(source, want_source):
        wrong.append(("corpus", cfg.corpus, ""))
        use.append(("corpus", "" if made_default else source))
    same_corpus = not wrong
    glob = meta.get("glob")
    want_glob = resolve_glob(cfg.corpus_glob, want_default)
    if same_corpus and glob is not None and want_glob != glob:
        wrong.append(("corpus_glob", cfg.corpus_glob, "" if cfg.corpus_glob else f"= {want_glob!r}"))
        use.append(("corpus_glob", req.get("corpus_glob", glob)))

    tok_source = meta.get("tokenizer_source")
    if "tokenizer" in req:
        trained, vocab = req["tokenizer"] == "", req.get("vocab_size")
    elif isinstance(tok_source, str):
        m = _TRAINED.fullmatch(tok_source)
        trained, vocab = m is not None, int(m.group(1)) if m else None
    else:
        trained, vocab = None, None  # unknown: nothing to compare
    sha = meta.get("tokenizer_sha256")
    copy = os.path.join(cfg.path, meta.get("tokenizer", "tokenizer.json"))
    if cfg.tokenizer:
        if sha and tokenizer_file_sha256(cfg.tokenizer) != sha:
            wrong.append(("tokenizer", cfg.tokenizer, "not the tokenizer the shards were made with"))
            use.append(("tokenizer", "" if trained else copy))
    elif trained is False:
        wrong.append(("tokenizer", "", "train a BPE"))
        use.append(("tokenizer", copy))
    elif trained and vocab is not None and vocab != cfg.vocab_size:
        wrong.append(("vocab_size", cfg.vocab_size, ""))
        use.append(("vocab_size", vocab))

    if same_corpus and "max_files" in req:
        for key in ("max_files", "max_bytes"):
            if want_default and req[key] != getattr(cfg, key):
                wrong.append((key, getattr(cfg, key), ""))
                use.append((key, req[key]))
            elif not want_default and req[key]:  # capped by hand with the CLI; the config never caps a user corpus
                wrong.append((key, getattr(cfg, key), "caps apply to the stdlib corpus only"))
    if not wrong and trained and not cfg.tokenizer:
        _check_special_tokens(cfg, meta, copy)
    if not wrong:
        return

    details = [f"glob {glob!r}"] if glob is not None else []
    if trained:
        details.append(f"vocab {vocab}" if vocab is not None else "a trained BPE")
    elif trained is False:
        details.append(f"tokenizer {tok_source!r}")
    if made_default and "max_files" in req:
        details += [f"max_files {req['max_files']}", f"max_bytes {req['max_bytes']}"]
    corpus = "'<stdlib>'" if made_default else repr(source)
    held = f"corpus {corpus}" + (f" ({', '.join(details)})" if details else "")
    asked = ", ".join(f"data.{k}={v!r}" + (f" ({why})" if why else "") for k, v, why in wrong)
    new = _suggest_path(cfg, {k for k, _, _ in wrong})
    fix = "set data.path to a new directory" + (f" (e.g. data.path={new})" if new else "") + " to prepare it there"
    if use:
        fix += ", or set " + " ".join(f"data.{k}={v!r}" for k, v in use) + " to use these shards"
    raise DataConfigError(f"data.path={cfg.path!r} holds shards prepared from {held}, but {asked}: {fix}")


_BEFORE_CHAT_TOKENS = [BOS, EOS, PAD]  # what a trained BPE reserved before meta.json recorded its special tokens


def _check_special_tokens(cfg: DataConfig, meta: dict, copy: str) -> None:
    """Refuse shards whose trained tokenizer reserved other special tokens than this build trains (one recorded
    before the chat markers existed, say): the ids differ, and so would a re-preparation's."""
    made = meta.get("special_tokens", _BEFORE_CHAT_TOKENS)
    if made == list(SPECIAL_TOKENS):
        return
    raise DataConfigError(
        f"data.path={cfg.path!r} holds shards whose tokenizer was trained with the special tokens {made} (an older "
        f"build); this build trains {list(SPECIAL_TOKENS)}: delete {cfg.path} to prepare it again, or set data.path "
        f"to a new directory to prepare it there, or set data.tokenizer={copy!r} to use these shards as they are"
    )


def _suggest_path(cfg: DataConfig, keys: set[str]) -> str | None:
    """A sibling of data.path named after what the config asks for; None when that would be data.path itself."""
    path = os.path.normpath(cfg.path)
    if "corpus" in keys:
        name = os.path.splitext(os.path.basename(os.path.normpath(cfg.corpus)))[0] if cfg.corpus else "stdlib"
    else:
        name = os.path.basename(path)
    if "vocab_size" in keys:
        name += f"-{cfg.vocab_size}"
    if "tokenizer" in keys and cfg.tokenizer:
        name += "-" + os.path.splitext(os.path.basename(cfg.tokenizer))[0]
    new = os.path.join(os.path.dirname(path), name)
    # never the corpus itself, nor a directory inside it (its own shards would become part of the corpus)
    if cfg.corpus and os.path.realpath(new).startswith(os.path.realpath(cfg.corpus)):
        new = os.path.join(os.path.dirname(path), name + "-shards")
        if os.path.realpath(new).startswith(os.path.realpath(cfg.corpus) + os.sep):
            return None
    return None if new == path else new


def tokenizer_path(cfg: DataConfig) -> str:
    """The tokenizer the shards at `cfg.path` were made with (data.tokenizer, or the prepared one, checked against
    meta.json's sha256)."""
    meta, _ = read_meta(cfg.path, prepare_command(cfg))
    check_provenance(cfg, meta)  # the same rule as ensure_prepared, for callers that go straight here
    tok_path = cfg.tokenizer or os.path.join(cfg.path, meta["tokenizer"])
    if not cfg.tokenizer:
        try:
            intact = file_sha256(tok_path) == meta["tokenizer_sha256"]
        except OSError:
            intact = False
        if not intact:
            raise DataConfigError(
                f"data.path={cfg.path!r}: {meta['tokenizer']} is missing or not the one meta.json records "
                "(overwritten?); prepare data.path again"
            )
    return tok_path


def build_dataloader(cfg: DataConfig, rank: int = 0, world_size: int = 1):
    """(PackedLoader, TokenizerInfo) for data-parallel `rank` of `world_size` over the shards at `cfg.path`.

    Peers that must see the same batches (tensor / pipeline parallel) pass the same rank.
    """
    # Imported here so that importing the config schemas (trainer.config imports this module) does not pay for torch.
    import torch

    from data.loader import PackedLoader  # start-up: data.loader imports torch (see above)

    tok_path = tokenizer_path(cfg)
    info: TokenizerInfo = tokenizer_info(load_tokenizer(tok_path), tok_path)
    loader = PackedLoader(
        cfg.path, seq_len=cfg.seq_len, batch_size=cfg.batch_size, eos_id=info.eos_id, num_workers=cfg.num_workers,
        seed=cfg.seed, shuffle=cfg.shuffle, shuffle_buffer=cfg.shuffle_buffer, rank=rank, world_size=world_size,
        pin_memory=torch.cuda.is_available(),
    )
    return loader, info
