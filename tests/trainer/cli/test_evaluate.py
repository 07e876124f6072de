"""`python -m trainer.cli.evaluate` on the micro model: `sft_eval` reproduces the `eval/loss` the SFT stage logged for
the same weights; text and the shards data.prepare makes of it score the same; the default row is the run's training
data, marked so; windows pack as the pretraining loader does; a missing corpus, shards of another tokenizer, a bad
.jsonl line and a checkpoint outside a run directory without a corpus are one line, exit 2."""

from __future__ import annotations

import colorsys
import json.decoder
import math
import shutil
import sys
import textwrap

import numpy as np
import pytest
import torch

from data.config import DataConfig, ensure_prepared
from tests.fork_server import run_module
from tests.trainer.harness import REPO, env, micro_overrides, read_metrics, run_cli
from trainer.checkpoint.loading import find_checkpoint, run_tokenizer
from trainer.cli.evaluate import EvaluateConfig, evaluate, windows

HOOKED = ["model.attention.head_dim=32", "model.csa2.index_head_dim=32"]  # as tests/trainer/test_stages.py


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_data):
    """A 4-step pretraining run and a 2-step SFT run from it: {name: run dir}."""
    pre, sft = tmp_path_factory.mktemp("pretrain"), tmp_path_factory.mktemp("sft")
    r = run_cli(micro_overrides(pre, small_data, *HOOKED, "trainer.max_steps=4", "checkpoint.interval=4"))
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_cli(micro_overrides(sft, small_data, *HOOKED, "trainer.max_steps=2", "checkpoint.interval=2",
                                f"checkpoint.init_from={pre}", "stage=sft", "stage.num_samples=32",
                                "stage.num_eval=12", "stage.eval_every=0"))
    assert r.returncode == 0, r.stderr[-2000:]
    return {"pretrain": pre, "sft": sft}


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _cli(*args):
    return run_module("trainer.cli.evaluate", list(map(str, args)), cwd=REPO, env=env(), timeout=300)


def test_sft_eval_is_the_stage_s_held_out_loss(runs, one_thread):
    logged = {r["step"]: r["eval/loss"] for r in read_metrics(runs["sft"]) if "eval/loss" in r}
    (row,) = evaluate(EvaluateConfig(ckpt=str(runs["sft"]), sft_eval=True, num_threads=1))
    assert row.what.startswith("sft held-out (12 samples, the run's settings)")
    assert row.loss == pytest.approx(logged[2], abs=1e-4)  # the same weights, samples and batches
    assert row.tokens > 0 and row.perplexity == pytest.approx(math.exp(row.loss))


def test_text_scores_as_its_prepared_shards(runs, tmp_path, one_thread):
    text = tmp_path / "text"
    text.mkdir()
    for module in (json.decoder, textwrap, colorsys):  # three documents of the standard library
        shutil.copy(module.__file__, text / f"{module.__name__}.py")
    tokenizer = run_tokenizer(find_checkpoint(str(runs["pretrain"])))
    shards = tmp_path / "shards"
    ensure_prepared(DataConfig(path=str(shards), corpus=str(text), tokenizer=tokenizer, max_bytes=0), progress=False)
    raw, prepared = evaluate(EvaluateConfig(ckpt=str(runs["pretrain"]), corpus=[str(text), str(shards)],
                                           max_tokens=0, num_threads=1))
    assert raw.tokens == prepared.tokens > 1000
    assert raw.loss == pytest.approx(prepared.loss, rel=1e-6)
    assert 0 < raw.loss < math.log(4096) + 1  # the micro model's vocabulary: near uniform after 4 steps
    (default,) = evaluate(EvaluateConfig(ckpt=str(runs["pretrain"]), max_tokens=256, num_threads=1))
    assert default.what.endswith("(the run's training data, not held out)") and default.tokens == 256


def test_windows_pack_as_the_pretraining_loader():
    docs = [np.array([1, 2, 3]), np.array([4, 5])]
    assert windows(iter(docs), 0, 2, 0).tolist() == [[1, 2, 3], [3, 0, 4], [4, 5, 0]]
    assert windows(iter(docs), 0, 2, 3).tolist() == [[1, 2, 3]]  # at most 3 predicted tokens: one whole window
    assert windows(iter(docs), 0, 16, 0).tolist() == [[1, 2, 3, 0, 4, 5, 0]]  # shorter than a window


def test_the_command_prints_one_table(runs):
    r = _cli(f"ckpt={runs['pretrain']}", "max_tokens=64", "num_threads=1", "batch_size=2")
    assert r.returncode == 0, r.stderr
    head, columns, row = r.stdout.strip().splitlines()
    assert head.startswith("checkpoint ") and "step 4" in head and "CPU threads 1 (set)" in head
    assert columns.split() == ["set", "tokens", "loss", "perplexity"]
    loss, perplexity = map(float, row.split()[-2:])
    assert row.split()[-3] == "64" and perplexity == pytest.approx(math.exp(loss), rel=1e-3)


def test_bad_inputs_are_one_line_exit_2(runs, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.txt").write_text("hello world, a corpus with a tokenizer of its own\n" * 50)
    ensure_prepared(DataConfig(path=str(tmp_path / "other-shards"), corpus=str(other), vocab_size=300,
                               max_bytes=0), progress=False)
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n{"txt": "y"}\n')
    outside = tmp_path / "step_00000004"
    shutil.copytree(runs["pretrain"] / "checkpoints" / "step_00000004", outside)
    cases = [
        ([f"ckpt={runs['pretrain']}", f"corpus=[{tmp_path / 'missing'}]"], "no such file or directory"),
        ([f"ckpt={runs['pretrain']}", f"corpus=[{tmp_path / 'other-shards'}]"], "prepared with another tokenizer"),
        ([f"ckpt={runs['pretrain']}", f"corpus=[{tmp_path / 'bad.jsonl'}]"], "bad.jsonl:2"),
        ([f"ckpt={outside}", "tokenizer=" + run_tokenizer(find_checkpoint(str(runs["pretrain"])))],
         "is not in a run directory: give corpus=[<path>] or sft_eval=true"),
        (["ckpt=" + str(tmp_path / "nothing")], "does not exist"),
        ([f"ckpt={runs['pretrain']}", "max_tokens=-1"], "max_tokens"),
    ]
    for args, message in cases:
        r = _cli(*args)
        assert r.returncode == 2 and r.stdout == "", (args, r.stderr)
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and message in r.stderr, r.stderr



@pytest.mark.parametrize("tty", [True, False])
def test_scoring_shows_a_bar_on_a_terminal_only(tty, runs, one_thread, monkeypatch, capsys):
    """Issue 44's 'long silent phases say what they do': scoring a corpus took 115 s without a word on a loaded
    machine. A terminal sees a bar per set; output to a file or a pipe stays the table alone."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    evaluate(EvaluateConfig(ckpt=str(runs["sft"]), sft_eval=True, num_threads=1))
    err = capsys.readouterr().err
    assert ("scoring sft held-out" in err) is tty and (err == "") is (not tty)
