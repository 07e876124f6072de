"""The tokenizer (data/tokenizer.py): a trained byte-level BPE puts <bos>, <eos>, <pad> at ids 0, 1, 2 (so
model.engram.pad_id = 2 names <pad>) and the chat markers at 3 .. 8, none produced by plain text; it decodes back
to the exact text (whitespace and non-ASCII included) and encodes bytes it never saw; an existing tokenizer.json is loaded with its own special ids found by name; a
tokenizer without an end-of-text token, a missing file and a too-small vocabulary are clear errors."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from data.tokenizer import (
    CHAT_TOKENS,
    MIN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    ids_dtype,
    load_tokenizer,
    tokenizer_info,
    train_tokenizer,
)
from tests.data.synthetic import write_text_corpus


def test_trained_special_ids_and_exact_round_trip(tmp_path):
    texts = write_text_corpus(tmp_path)
    tok = train_tokenizer(iter(texts), vocab_size=400)
    info = tokenizer_info(tok, "mem")
    assert (info.bos_id, info.eos_id, info.pad_id) == (0, 1, 2)
    assert SPECIAL_TOKENS[3:] == CHAT_TOKENS and [tok.token_to_id(t) for t in CHAT_TOKENS] == list(range(3, 9))
    assert MIN_VOCAB_SIZE == 256 + 9
    assert 300 < info.vocab_size <= 400
    for text in texts + ["  indented\n\ttabs  \r\n", "emoji 🦜 never seen"]:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
        assert min(ids) >= len(SPECIAL_TOKENS), "plain text must not produce special ids"
    # Real text compresses: fewer tokens than bytes.
    assert len(tok.encode(texts[0]).ids) < len(texts[0].encode()) / 2


def test_save_and_load_existing_tokenizer(tmp_path):
    texts = write_text_corpus(tmp_path)
    tok = train_tokenizer(texts, vocab_size=350)
    path = str(tmp_path / "tok.json")
    tok.save(path)
    loaded = load_tokenizer(path)
    assert loaded.encode(texts[3]).ids == tok.encode(texts[3]).ids
    assert tokenizer_info(loaded, path).path == path


def _word_level(vocab: dict[str, int]) -> Tokenizer:
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def test_foreign_special_names():
    tok = _word_level({"[UNK]": 0, "hello": 1, "<|endoftext|>": 7, "[PAD]": 5})
    info = tokenizer_info(tok, "gpt-style")
    assert (info.eos_id, info.pad_id, info.bos_id) == (7, 5, None)


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="no end-of-text token"):
        tokenizer_info(_word_level({"[UNK]": 0, "a": 1}), "x.json")
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_tokenizer(str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        load_tokenizer(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match=str(MIN_VOCAB_SIZE)):
        train_tokenizer(["x"], vocab_size=100)


def test_ids_dtype():
    assert ids_dtype(4096) == "<u2" and ids_dtype(65536) == "<u2"
    assert ids_dtype(65537) == "<u4" and ids_dtype(129_280) == "<u4"
