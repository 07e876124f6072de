"""The data config and entry points (data/config.py): conf/data/default.yaml is exactly the schema's defaults
and merges into it (a misspelled key is refused, a bad value raises ValueError naming data.<field>);
ensure_prepared prepares a missing directory when allowed (a user corpus uncapped), does nothing when shards
exist, and otherwise fails naming the path and `python -m data.prepare`; build_dataloader returns a loader whose
ids fit the tokenizer it reports, and refuses a tokenizer other than the one the shards were made with. The schema
lives in data/schema.py, which data/prepare.py imports at the top: no import cycle, and `python -m data.prepare`
loads neither data.config nor torch."""

import dataclasses
import os
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError

from data.config import DataConfig, build_dataloader, ensure_prepared
from data.shards import read_meta
from data.tokenizer import train_tokenizer

REPO = Path(__file__).resolve().parents[2]


def _yaml():
    y = OmegaConf.load(REPO / "conf" / "data" / "default.yaml")
    y.pop("defaults")
    return y


def test_yaml_matches_schema_defaults():
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), _yaml()))
    assert cfg == DataConfig()


def test_misspelled_key_and_bad_values():
    with pytest.raises(ConfigKeyError, match="seq_length"):
        OmegaConf.merge(OmegaConf.structured(DataConfig), {"seq_length": 64})
    bad = {"seq_len": 0, "batch_size": -1, "num_workers": -1, "shuffle_buffer": 0, "shard_size": 0,
           "max_bytes": -5, "vocab_size": 100, "path": "", "corpus_glob": "/abs/*.py", "prepare_timeout_s": 0}
    for name, value in bad.items():
        with pytest.raises(ValueError, match=f"data.{name} must"):
            DataConfig(**{name: value})
    merged = OmegaConf.merge(OmegaConf.structured(DataConfig), {"seq_len": -3})
    with pytest.raises(ValueError, match="data.seq_len must be > 0, got -3"):
        OmegaConf.to_object(merged)


def test_prepare_cli_imports_neither_data_config_nor_torch():
    import data.prepare
    import data.schema

    assert DataConfig is data.schema.DataConfig is data.prepare.DataConfig
    probe = ("import sys, runpy; sys.argv = ['data.prepare', '--help']\n"
             "try:\n    runpy.run_module('data.prepare', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "print(sorted(m for m in sys.modules if m == 'torch' or m == 'data.config'))")
    r = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--vocab-size" in r.stdout and r.stdout.splitlines()[-1] == "[]", r.stdout + r.stderr


def _cfg(tmp_path, corpus, **kw):
    return DataConfig(path=str(tmp_path / "shards"), corpus=str(corpus), corpus_glob="*.txt", vocab_size=300,
                      shard_size=64, seq_len=16, batch_size=2, **kw)


def test_ensure_prepared(tmp_path, text_corpus):
    corpus, texts = text_corpus
    off = _cfg(tmp_path, corpus, auto_prepare=False)
    with pytest.raises(FileNotFoundError, match=rf"{off.path}.*python -m data\.prepare"):
        ensure_prepared(off)
    cfg = dataclasses.replace(off, auto_prepare=True, max_files=2, max_bytes=10)
    assert ensure_prepared(cfg, progress=False) == cfg.path
    meta, _ = read_meta(cfg.path)
    assert meta["num_documents"] == len(texts), "caps are for the default corpus only"
    stamp = os.stat(os.path.join(cfg.path, "meta.json")).st_mtime_ns
    ensure_prepared(cfg)  # already there: untouched
    assert os.stat(os.path.join(cfg.path, "meta.json")).st_mtime_ns == stamp
    assert ensure_prepared(off) == off.path  # prepared now, so auto_prepare no longer matters


def test_build_dataloader(tmp_path, text_corpus):
    corpus, _ = text_corpus
    cfg = _cfg(tmp_path, corpus)
    with pytest.raises(FileNotFoundError, match=rf"{cfg.path}.*python -m data\.prepare"):
        build_dataloader(cfg)
    ensure_prepared(cfg, progress=False)
    loader, info = build_dataloader(cfg, rank=1, world_size=2)
    assert (info.eos_id, info.bos_id, info.pad_id) == (1, 0, 2)
    assert info.path == os.path.join(cfg.path, "tokenizer.json")
    for batch in islice(iter(loader), 5):
        assert batch["input_ids"].shape == (2, 16)
        assert 0 <= int(batch["input_ids"].min()) and int(batch["input_ids"].max()) < info.vocab_size
    assert loader.skipped_shards == 0 and "dp_rank_1" in loader.state_dict()
    # The same tokenizer named explicitly is fine; another one is refused.
    build_dataloader(dataclasses.replace(cfg, tokenizer=info.path))
    train_tokenizer(["something else entirely"], vocab_size=270).save(str(tmp_path / "other.json"))
    with pytest.raises(ValueError, match="not the tokenizer the shards"):
        build_dataloader(dataclasses.replace(cfg, tokenizer=str(tmp_path / "other.json")))
