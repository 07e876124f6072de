"""Byte-level BPE tokenizer: training on a corpus, loading an existing `tokenizer.json`, and the special ids.

Contract: a tokenizer trained here (`train_tokenizer`) reserves ids 0 .. 8: <bos>, <eos>, <pad> (eos 1 and pad 2 as
the flagship's public tokenizer has them), then the chat markers (`CHAT_TOKENS`: the four roles, <|end|>,
<|effort|>). A loaded tokenizer (`load_tokenizer`) keeps its own ids: the special tokens are looked up by name
(`tokenizer_info`, `first_id`), so any `tokenizer.json` with a recognisable end-of-text token works. `ids_dtype`
says how the shards store its ids. The packer separates documents with <eos> only.

Design and reasoning: docs/data.md#tokenizer-and-special-ids
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"
SYSTEM, USER, ASSISTANT, TOOL = "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"
END, EFFORT = "<|end|>", "<|effort|>"
CHAT_TOKENS = (SYSTEM, USER, ASSISTANT, TOOL, END, EFFORT)
"""the chat template's markers (data/chat.py), in the order a trained tokenizer numbers them (ids 3 .. 8)"""
SPECIAL_TOKENS = (BOS, EOS, PAD, *CHAT_TOKENS)
"""trained tokenizers give these ids 0, 1, 2, ... (BpeTrainer numbers special tokens first, in list order)"""

# Names under which common tokenizers spell the same tokens; ours come first (data/chat.py looks them up too).
BOS_NAMES = (BOS, "<s>", "<|begin_of_text|>", "<｜begin▁of▁sentence｜>")
EOS_NAMES = (EOS, "</s>", "<|endoftext|>", "<|end_of_text|>", "<｜end▁of▁sentence｜>")
PAD_NAMES = (PAD, "<｜▁pad▁｜>", "<|pad|>", "[PAD]")

MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
"""the byte alphabet plus the special tokens: below this a byte-level BPE cannot encode every input"""


@dataclass(frozen=True)
class TokenizerInfo:
    """What the trainer needs to know about the tokenizer behind the shards."""

    path: str
    vocab_size: int
    """number of ids the tokenizer can emit; the model's vocab_size must be at least this"""
    eos_id: int
    """separates packed documents"""
    bos_id: int | None
    pad_id: int | None


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on `texts` (an iterable, consumed once, so it can stream from disk)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} special tokens), "
            f"got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: source code is whitespace-sensitive, and decode(encode(x)) must give x back.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # Seeding all 256 byte symbols means any text encodes, even bytes absent from the training corpus.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(len(SPECIAL_TOKENS))), f"special tokens got ids {ids}"
    return tok


def load_tokenizer(path: str) -> Tokenizer:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer file {path!r} does not exist")
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # the Rust side raises a bare Exception for malformed JSON
        raise ValueError(f"cannot load tokenizer {path}: {exc}") from exc


def first_id(tok: Tokenizer, names: tuple[str, ...]) -> int | None:
    """The id of the first of `names` that `tok` knows (the aliases above), None when it knows none."""
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    return None


def tokenizer_info(tok: Tokenizer, path: str) -> TokenizerInfo:
    eos = first_id(tok, EOS_NAMES)
    if eos is None:
        raise ValueError(
            f"tokenizer {path} has no end-of-text token (looked for {list(EOS_NAMES)}); "
            "the packer needs one to separate documents"
        )
    return TokenizerInfo(
        path=path,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        eos_id=eos,
        bos_id=first_id(tok, BOS_NAMES),
        pad_id=first_id(tok, PAD_NAMES),
    )


def ids_dtype(vocab_size: int) -> str:
    """Storage dtype of token ids in shards: the narrowest little-endian unsigned type that holds every id."""
    return "<u2" if vocab_size <= 1 << 16 else "<u4"

