"""What prepared shards were made from, and preparing them safely (data/config.py, data/prepare.py).

Proves: shards at data.path are refused, in one ValueError line naming data.path, what the shards hold and the
keys that disagree, when the config asks for another corpus, glob, tokenizer, vocab_size or stdlib cap (the
suggested fixes work; shard_size and the caps of a user corpus do not matter); shards of an older build without
the `requested` section still load when what they record agrees, but not those whose trained tokenizer reserved
other special tokens (a build before the chat markers); an empty data.corpus_glob means `*.py` for the
stdlib and every (non-hidden) file of a user directory, and an explicit glob that matches nothing fails naming
data.corpus_glob and data.corpus; a missing data.path (with the exact prepare command, which works), data.corpus
or data.tokenizer, and an unloadable data.tokenizer, fail naming the key; several processes preparing one
directory at once publish a single preparation identical to a serial one; a dead preparer's lock (a pid gone
from this host, or a heartbeat long stopped) and build directory are taken over, a live one is waited for until
data.prepare_timeout_s; a held lock's heartbeat keeps it fresh.
"""

import dataclasses
import json
import multiprocessing as mp
import os
import re
import shlex
import socket
import subprocess
import sys
import time

import pytest

from data.config import DataConfig, build_dataloader, ensure_prepared
from data.prepare import LOCK_NAME, PrepareLock, main
from data.shards import DataConfigError, read_meta
from data.tokenizer import SPECIAL_TOKENS, train_tokenizer


def _cfg(path, corpus="", **kw) -> DataConfig:
    kw = {"vocab_size": 300, "shard_size": 256, "seq_len": 16, "batch_size": 2, **kw}
    return DataConfig(path=str(path), corpus=str(corpus), **kw)


def _stdlib_cfg(path, **kw) -> DataConfig:
    return _cfg(path, max_files=3, **kw)  # three stdlib files: enough text, prepared in a fraction of a second


def _refusal(cfg) -> str:
    with pytest.raises(DataConfigError) as exc:
        ensure_prepared(cfg, progress=False)
    message = str(exc.value)
    assert "\n" not in message and isinstance(exc.value, ValueError)
    return message


def test_a_custom_corpus_does_not_reuse_the_default_shards(tmp_path, text_corpus):
    corpus, _ = text_corpus
    default = _stdlib_cfg(tmp_path / "stdlib")
    ensure_prepared(default, progress=False)
    assert read_meta(default.path)[0]["glob"] == "*.py", "an empty glob means *.py for the stdlib"
    mine = dataclasses.replace(default, corpus=str(corpus))
    assert _refusal(mine) == (
        f"data.path='{default.path}' holds shards prepared from corpus '<stdlib>' (glob '*.py', vocab 300, "
        f"max_files 3, max_bytes 8000000), but data.corpus='{corpus}': set data.path to a new directory "
        f"(e.g. data.path={tmp_path / 'corpus'}-shards) to prepare it there, or set data.corpus='' to use these shards"
    )
    # Both suggested fixes work: a new path prepares the corpus there, the old value uses the shards.
    ensure_prepared(dataclasses.replace(mine, path=str(tmp_path / "corpus-shards")), progress=False)
    ensure_prepared(dataclasses.replace(mine, corpus=""), progress=False)
    # The stdlib caps are part of what the shards hold.
    message = _refusal(dataclasses.replace(default, max_bytes=400_000))
    assert "but data.max_bytes=400000: " in message and "or set data.max_bytes=8000000 to use" in message


def test_every_preparation_key_is_checked(tmp_path, text_corpus):
    corpus, _ = text_corpus
    cfg = _cfg(tmp_path / "shards", corpus)
    ensure_prepared(cfg, progress=False)
    path = cfg.path

    message = _refusal(dataclasses.replace(cfg, vocab_size=320))
    assert message.startswith(f"data.path='{path}' holds shards prepared from corpus '{corpus}' (glob '*', vocab 300)")
    assert "but data.vocab_size=320: " in message and f"data.path={path}-320" in message
    assert message.endswith("or set data.vocab_size=300 to use these shards")

    message = _refusal(dataclasses.replace(cfg, corpus_glob="doc_0*.txt"))
    assert "but data.corpus_glob='doc_0*.txt': " in message and "set data.corpus_glob='' to use" in message

    other = tmp_path / "other.json"
    train_tokenizer(["something else entirely"], vocab_size=270).save(str(other))
    wrong_tok = dataclasses.replace(cfg, tokenizer=str(other))
    message = _refusal(wrong_tok)
    assert f"but data.tokenizer='{other}' (not the tokenizer the shards were made with)" in message
    with pytest.raises(DataConfigError) as exc:  # one rule, one message, whichever entry point meets it
        build_dataloader(wrong_tok)
    assert str(exc.value) == message

    # Shards made with a given tokenizer need it named (the copy next to them will do).
    given = _cfg(tmp_path / "given", corpus, tokenizer=str(other))
    ensure_prepared(given, progress=False)
    message = _refusal(dataclasses.replace(given, tokenizer=""))
    assert f"tokenizer '{other}'" in message and "but data.tokenizer='' (train a BPE)" in message
    copy = os.path.join(given.path, "tokenizer.json")
    assert f"or set data.tokenizer='{copy}' to use" in message
    ensure_prepared(dataclasses.replace(given, tokenizer=copy, vocab_size=4096), progress=False)  # vocab unused

    # Accepted: the same tokenizer by its path, another shard size (same ids, other grouping), caps (stdlib only).
    accepted = dataclasses.replace(cfg, tokenizer=os.path.join(path, "tokenizer.json"), shard_size=1 << 20,
                                   max_files=2, max_bytes=10)
    ensure_prepared(accepted, progress=False)
    build_dataloader(accepted)


def test_shards_of_an_older_build_still_load(tmp_path, text_corpus):
    corpus, _ = text_corpus
    cfg = _cfg(tmp_path / "shards", corpus)
    ensure_prepared(cfg, progress=False)
    meta_path = os.path.join(cfg.path, "meta.json")
    meta = json.loads(open(meta_path).read())
    del meta["requested"]  # what a build before the provenance check wrote
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    ensure_prepared(cfg, progress=False)
    build_dataloader(cfg)
    # What they do record is still compared: the trained vocabulary (from tokenizer_source) and the corpus.
    assert "but data.vocab_size=512: " in _refusal(dataclasses.replace(cfg, vocab_size=512))
    assert "but data.corpus='elsewhere': " in _refusal(dataclasses.replace(cfg, corpus="elsewhere"))
    for key in ("source", "glob", "tokenizer_source"):
        del meta[key]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    ensure_prepared(dataclasses.replace(cfg, vocab_size=512, corpus="elsewhere"), progress=False)  # nothing to compare


def test_shards_trained_with_other_special_tokens_are_refused(tmp_path, text_corpus):
    corpus, _ = text_corpus
    cfg = _cfg(tmp_path / "shards", corpus)
    ensure_prepared(cfg, progress=False)
    meta_path = os.path.join(cfg.path, "meta.json")
    meta = json.loads(open(meta_path).read())
    assert meta["special_tokens"] == list(SPECIAL_TOKENS)
    del meta["special_tokens"]  # what a build before the chat markers wrote: its BPE reserved <bos>, <eos>, <pad>
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    copy = os.path.join(cfg.path, "tokenizer.json")
    assert _refusal(cfg) == (
        f"data.path='{cfg.path}' holds shards whose tokenizer was trained with the special tokens "
        f"['<bos>', '<eos>', '<pad>'] (an older build); this build trains {list(SPECIAL_TOKENS)}: delete {cfg.path} "
        f"to prepare it again, or set data.path to a new directory to prepare it there, or set "
        f"data.tokenizer='{copy}' to use these shards as they are")
    with pytest.raises(DataConfigError) as exc:
        build_dataloader(cfg)
    assert str(exc.value) == _refusal(cfg)
    ensure_prepared(dataclasses.replace(cfg, tokenizer=copy), progress=False)  # the suggested fix works


def test_an_empty_glob_takes_every_file_of_a_directory(tmp_path):
    corpus = tmp_path / "notes"
    for rel, text in {"a.txt": "first note", "b.md": "# second", "sub/c.rst": "third", "sub/.d.swp": "swap",
                      ".git/HEAD": "ref: refs/heads/main"}.items():
        (corpus / rel).parent.mkdir(parents=True, exist_ok=True)
        (corpus / rel).write_text(text)
    (corpus / "latin1.txt").write_bytes(b"caf\xe9")  # not UTF-8: skipped and counted
    cfg = _cfg(tmp_path / "shards", corpus)
    ensure_prepared(cfg, progress=False)
    meta = read_meta(cfg.path)[0]
    assert (meta["num_documents"], meta["files_skipped"], meta["glob"]) == (3, 1, "*")
    assert meta["requested"]["corpus_glob"] == ""
    # The CLI's --glob default follows the same rule.
    main(["--corpus", str(corpus), "--out", str(tmp_path / "cli"), "--vocab-size", "300", "--no-progress"])
    assert read_meta(str(tmp_path / "cli"))[0]["num_documents"] == 3
    # An explicit pattern that matches nothing is an error naming both keys.
    with pytest.raises(DataConfigError, match=rf"^data\.corpus_glob='\*\.py' matches no file under "
                                              rf"data\.corpus='{corpus}' \(data\.corpus_glob='' takes every file\)$"):
        ensure_prepared(_cfg(tmp_path / "py", corpus, corpus_glob="*.py"), progress=False)


def test_io_faults_name_the_key(tmp_path, text_corpus):
    corpus, _ = text_corpus
    off = _cfg(tmp_path / "shards", corpus, corpus_glob="*.txt", auto_prepare=False)
    with pytest.raises(ValueError) as exc:
        ensure_prepared(off)
    assert isinstance(exc.value, FileNotFoundError)
    cmd = (f"python -m data.prepare --corpus {corpus} --out {off.path} --glob '*.txt' --vocab-size 300 "
           "--shard-size 256")
    assert str(exc.value) == (f"data.path='{off.path}' does not exist; prepare it with `{cmd}` "
                              "or set data.auto_prepare=true")
    main([*shlex.split(cmd)[3:], "--no-progress"])  # the command given prepares what the config accepts
    ensure_prepared(off)

    missing = tmp_path / "nope"
    fresh = tmp_path / "fresh"
    with pytest.raises(ValueError, match=f"^data.corpus='{missing}' does not exist$"):
        ensure_prepared(_cfg(fresh, missing), progress=False)
    assert not fresh.exists(), "nothing is created for a config that cannot work"
    (tmp_path / "bad.json").write_text("{not json")
    for tok, match in ((missing, "does not exist"), (tmp_path, "is not a file"),
                       (tmp_path / "bad.json", "cannot be loaded as a tokenizer.json: ")):
        with pytest.raises(ValueError, match=f"^data.tokenizer='{tok}' {match}"):
            ensure_prepared(_cfg(fresh, corpus, tokenizer=str(tok)), progress=False)
    with pytest.raises(ValueError, match=f"^data.tokenizer='{missing}' does not exist$"):  # shards already there
        ensure_prepared(dataclasses.replace(off, tokenizer=str(missing)))
    assert not fresh.exists()


def _prepare_in_child(cfg: DataConfig, marker_dir: str, start) -> None:
    # Runs in a fresh (spawned) interpreter: count the preparations this process runs, then race the others.
    import data.config

    real = data.config.prepare

    def counted(*args, **kwargs):
        open(os.path.join(marker_dir, f"prepared-by-{os.getpid()}"), "w").close()
        return real(*args, **kwargs)

    data.config.prepare = counted
    start.wait()
    data.config.ensure_prepared(cfg, progress=False)


def test_processes_preparing_at_once_publish_one_preparation(tmp_path, text_corpus):
    corpus, _ = text_corpus
    cfg = _cfg(tmp_path / "shared", corpus)
    (tmp_path / "markers").mkdir()
    ctx = mp.get_context("spawn")  # not fork: the parent's tokenizer thread pool must not be forked
    start = ctx.Barrier(4)
    procs = [ctx.Process(target=_prepare_in_child, args=(cfg, str(tmp_path / "markers"), start)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    for p in procs:
        if p.is_alive():  # hung: fail below, without leaving the process behind
            p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0] * 4
    assert len(os.listdir(tmp_path / "markers")) == 1, "exactly one process prepared"
    serial = _cfg(tmp_path / "serial", corpus)
    ensure_prepared(serial, progress=False)
    shared_meta, serial_meta = read_meta(cfg.path)[0], read_meta(serial.path)[0]
    assert shared_meta == serial_meta and shared_meta["num_shards"] > 1
    for s in shared_meta["shards"]:
        with open(os.path.join(cfg.path, s["name"]), "rb") as a, open(os.path.join(serial.path, s["name"]), "rb") as b:
            assert a.read() == b.read()
    assert sorted(os.listdir(cfg.path)) == sorted(os.listdir(serial.path)), "no lock or build directory left"


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # reaped: the pid names no process now
    return p.pid


def _write_lock(directory, host: str, pid: int, age_s: float = 0.0) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_NAME)
    with open(path, "w") as f:
        json.dump({"host": host, "pid": pid, "time": time.time() - age_s, "token": "theirs"}, f)
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_a_dead_preparers_lock_is_taken_over(tmp_path, text_corpus):
    corpus, _ = text_corpus
    # On this host: the pid is gone, so the lock goes at once although its heartbeat is fresh.
    here = _cfg(tmp_path / "here", corpus)
    lock = _write_lock(here.path, socket.gethostname(), _dead_pid())
    t0 = time.monotonic()
    ensure_prepared(here, progress=False)
    assert time.monotonic() - t0 < 5 and not os.path.exists(lock)
    # On another node: only the heartbeat tells, and it stopped an hour ago; its build directory goes too.
    there = _cfg(tmp_path / "there", corpus)
    lock = _write_lock(there.path, "other-node", 4242, age_s=3600)
    abandoned = os.path.join(there.path, ".prepare-other-node-4242-0000")
    os.makedirs(abandoned)
    open(os.path.join(abandoned, "shard-000000.tar"), "w").close()
    os.utime(abandoned, (time.time() - 3600, time.time() - 3600))
    ensure_prepared(there, progress=False)
    assert sorted(os.listdir(there.path)) == sorted(os.listdir(here.path))


def test_a_live_preparer_is_waited_for_until_the_timeout(tmp_path, text_corpus):
    corpus, _ = text_corpus
    cfg = _cfg(tmp_path / "busy", corpus, prepare_timeout_s=0.3)
    lock = _write_lock(cfg.path, "other-node", 4242)
    message = _refusal(cfg)
    assert re.fullmatch(rf"data\.path='{cfg.path}' is still being prepared by host other-node pid 4242 "
                        rf"\(heartbeat \d+ s ago, lock file {lock}\) after 0\.3 s of waiting; "
                        r"raise data\.prepare_timeout_s, or delete the lock file if that process is gone", message)
    assert os.path.exists(lock), "a live preparer's lock is left alone"


def test_the_heartbeat_keeps_a_held_lock_fresh(tmp_path):
    held = PrepareLock(str(tmp_path), stale_after_s=0.6)  # heartbeat every 50 ms
    assert held.acquire()
    path = tmp_path / LOCK_NAME
    os.utime(path, (time.time() - 3600, time.time() - 3600))
    time.sleep(0.3)
    assert time.time() - path.stat().st_mtime < 0.3
    other = PrepareLock(str(tmp_path), stale_after_s=0.6)
    assert not other.acquire() and not other.take_over_if_stale()
    held.release()
    assert not path.exists()
    assert other.acquire()
    other.release()
