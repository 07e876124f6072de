"""Preparation (data/prepare.py): the shards hold exactly the tokenizer's ids of each document, in corpus order,
documents whole, split into several shards by size; meta.json describes them; undecodable and blank files are
skipped and counted; preparation is deterministic and a re-run leaves no stale shards; a crash mid-way leaves
the directory as it was (an earlier preparation intact, a fresh directory without meta.json, no build directory
behind); an existing tokenizer.json is used as is and copied; a vocabulary over 2**16 switches to uint32; .jsonl
corpora work; the default stdlib corpus prepares under a cap; a missing or empty corpus fails naming
data.corpus and the path, from Python and from `python -m data.prepare`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import data.prepare as prep
from data.prepare import main, prepare, stdlib_dir
from data.shards import read_meta, read_shard
from data.tokenizer import load_tokenizer, train_tokenizer
from tests.data.synthetic import write_text_corpus

REPO = Path(__file__).resolve().parents[2]


def _all_docs(out) -> list[list[int]]:
    meta, shards = read_meta(str(out))
    return [d.tolist() for s in shards for d in read_shard(os.path.join(out, s.name), s, meta["ids_dtype"])]


def test_shards_hold_the_tokenizers_ids_in_order(tmp_path, text_corpus):
    corpus, texts = text_corpus
    out = tmp_path / "out"
    meta = prepare(str(out), str(corpus), vocab_size=400, shard_size=256, glob="*.txt", progress=False)
    tok = load_tokenizer(str(out / "tokenizer.json"))
    expected = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    assert _all_docs(out) == expected
    assert meta["num_documents"] == len(texts) and meta["num_tokens"] == sum(map(len, expected))
    assert meta["vocab_size"] == tok.get_vocab_size() and meta["special_ids"] == {"bos": 0, "eos": 1, "pad": 2}
    assert meta["source"] == str(corpus) and meta["tokenizer"] == "tokenizer.json" and meta["files_skipped"] == 0
    on_disk = json.loads((out / "meta.json").read_text())
    assert on_disk["num_shards"] == meta["num_shards"] > 2
    # A shard closes at the first document that brings it to shard_size bytes.
    for s in on_disk["shards"][:-1]:
        assert s["num_tokens"] * 2 >= 256
    assert sorted(os.listdir(out)) == sorted(["meta.json", "tokenizer.json"] + [s["name"] for s in on_disk["shards"]])


def test_undecodable_and_blank_files_are_skipped(tmp_path, text_corpus):
    corpus, texts = text_corpus
    (corpus / "bad.txt").write_bytes(b"caf\xe9 latin-1, not utf-8")
    (corpus / "blank.txt").write_text(" \n\n")
    (corpus / "ignored.bin").write_text("not matched by the glob")
    meta = prepare(str(tmp_path / "out"), str(corpus), vocab_size=400, glob="*.txt", progress=False)
    assert meta["num_documents"] == len(texts) and meta["files_skipped"] == 2


def test_deterministic_and_rerun_removes_stale_shards(tmp_path, text_corpus):
    corpus, _ = text_corpus
    a, b = tmp_path / "a", tmp_path / "b"
    prepare(str(a), str(corpus), vocab_size=400, shard_size=128, glob="*.txt", progress=False)
    prepare(str(b), str(corpus), vocab_size=400, shard_size=128, glob="*.txt", progress=False)
    assert json.loads((a / "meta.json").read_text()) == json.loads((b / "meta.json").read_text())
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    many = read_meta(str(a))[0]["num_shards"]
    meta = prepare(str(a), str(corpus), vocab_size=400, shard_size=1 << 20, glob="*.txt", progress=False)
    assert meta["num_shards"] == 1 < many
    assert sorted(p.name for p in a.glob("shard-*")) == ["shard-000000.tar"]


def test_crash_midway_leaves_the_directory_as_it_was(tmp_path, text_corpus, monkeypatch):
    corpus, _ = text_corpus
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    prepare(str(out), str(corpus), vocab_size=400, shard_size=128, glob="*.txt", progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = prep.write_shard

    def crash_on_third(directory, index, *args):
        if index == 2:
            raise OSError("disk full")
        return real(directory, index, *args)

    monkeypatch.setattr(prep, "write_shard", crash_on_third)
    for d in (out, fresh):
        with pytest.raises(OSError, match="disk full"):
            prepare(str(d), str(corpus), vocab_size=300, shard_size=128, glob="*.txt", progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before, "the earlier preparation is untouched"
    assert _all_docs(out)
    assert os.listdir(fresh) == []
    with pytest.raises(FileNotFoundError, match="has no meta.json"):
        read_meta(str(fresh))


def test_existing_tokenizer_is_used_and_copied(tmp_path, text_corpus):
    corpus, texts = text_corpus
    other = write_text_corpus(tmp_path / "other", num_files=5, seed=7)
    tok = train_tokenizer(other, vocab_size=300)
    src = tmp_path / "mine.json"
    tok.save(str(src))
    out = tmp_path / "out"
    meta = prepare(str(out), str(corpus), tokenizer=str(src), glob="*.txt", progress=False)
    assert (out / "tokenizer.json").read_bytes() == src.read_bytes()
    assert meta["tokenizer_source"] == str(src) and meta["vocab_size"] == tok.get_vocab_size()
    assert _all_docs(out) == [tok.encode(t).ids for t in texts]


def test_vocabulary_over_16_bits_uses_uint32(tmp_path):
    words = [f"w{i}" for i in range(70_000)]
    tok = Tokenizer(models.WordLevel(vocab={"<eos>": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "d.txt").write_text("w3 w69999 w65534 w65535")
    meta = prepare(str(tmp_path / "out"), str(tmp_path / "c"), tokenizer=str(tmp_path / "big.json"), glob="*.txt",
                   progress=False)
    assert meta["ids_dtype"] == "<u4"
    assert _all_docs(tmp_path / "out") == [[5, 70001, 65536, 65537]]


def test_jsonl_corpus(tmp_path):
    lines = [{"text": "first document"}, {"text": ""}, {"text": "third, with ünïcode"}, {"text": "fourth"}]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    meta = prepare(str(out), str(src), vocab_size=300, progress=False)
    tok = load_tokenizer(str(out / "tokenizer.json"))
    assert meta["num_documents"] == 3 and meta["files_skipped"] == 1
    assert [tok.decode(d) for d in _all_docs(out)] == ["first document", "third, with ünïcode", "fourth"]
    meta = prepare(str(out), str(src), vocab_size=300, max_files=2, progress=False)
    assert meta["num_documents"] == 1 and meta["truncated_by_cap"]
    src.write_text('{"text": "fine"}\n{"txt": "typo"}\n')
    with pytest.raises(ValueError, match=r"c.jsonl:2: not a JSON object with a 'text' field"):
        prepare(str(out), str(src), vocab_size=300, progress=False)


def test_default_corpus_is_the_stdlib_under_a_cap(tmp_path):
    out = tmp_path / "out"
    meta = prepare(str(out), "", vocab_size=300, max_files=4, progress=False)
    assert meta["source"] == stdlib_dir() and meta["truncated_by_cap"]
    assert meta["num_documents"] + meta["files_skipped"] == 4
    root = Path(stdlib_dir())
    first = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    texts = [t for t in ((root / r).read_text() for r in first[:4]) if t.strip()]
    tok = load_tokenizer(str(out / "tokenizer.json"))
    assert [tok.decode(d) for d in _all_docs(out)] == texts


def test_missing_and_empty_corpus(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"data.corpus='{missing}' does not exist"):
        prepare(str(tmp_path / "out"), str(missing), progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"data.corpus='{tmp_path / 'empty'}' is empty"):
        prepare(str(tmp_path / "out"), str(tmp_path / "empty"), progress=False)
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.py").write_text("\n")
    with pytest.raises(ValueError, match=f"data.corpus='{tmp_path / 'blank'}' is empty: no non-blank"):
        prepare(str(tmp_path / "out"), str(tmp_path / "blank"), progress=False)
    with pytest.raises(SystemExit, match=str(missing)):
        main(["--corpus", str(missing), "--out", str(tmp_path / "out")])


def test_cli(tmp_path, text_corpus, capsys):
    corpus, texts = text_corpus
    out = tmp_path / "out"
    main(["--corpus", str(corpus), "--out", str(out), "--glob", "*.txt", "--vocab-size", "300",
          "--shard-size", "512", "--no-progress"])
    assert f"{len(texts)} documents" in capsys.readouterr().out
    assert read_meta(str(out))[0]["num_documents"] == len(texts)
    # As a module, in a fresh interpreter: the error names the path and the exit status is non-zero.
    r = subprocess.run([sys.executable, "-m", "data.prepare", "--corpus", str(tmp_path / "nope"), "--out",
                        str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and f"data.corpus='{tmp_path / 'nope'}' does not exist" in r.stderr
