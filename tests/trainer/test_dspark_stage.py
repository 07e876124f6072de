"""`stage=dspark` (trainer/stages/dspark.py) end to end on the micro model: the drafter trains on a pretrained run's
frozen backbone, every metrics record carries acceptance_len and predicted_acceptance_len, checkpoints hold the
drafter alone and name the backbone, a resume draws the uninterrupted run's anchors; no gradient reaches the backbone
and its weights stay bit for bit what was loaded; the anchors and the slots' targets are what the loss needs; bad
starts are refused in one line."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.trainer.harness import read_metrics, run_cli
from tests.trainer.test_stages import _args
from trainer.loss import IGNORE_INDEX

# the micro model's drafter: fed from its last three layers, a window and block that fit its 32 tokens
DRAFTER = ["model.dspark.target_layers=[1,2,3]", "model.dspark.window=8", "model.dspark.markov_rank=8",
           "model.dspark.num_experts=4", "model.dspark.experts_per_token=2", "model.dspark.block_size=4"]
K = 4


@pytest.fixture(scope="module")
def backbone(tmp_path_factory, small_data):
    run = tmp_path_factory.mktemp("backbone")
    r = run_cli(_args(run, small_data, *DRAFTER, "trainer.max_steps=6", "checkpoint.interval=6"))
    assert r.returncode == 0, r.stderr[-2000:]
    return run


def _dspark(run: Path, data: Path, backbone: Path, *extra: str) -> list[str]:
    return _args(run, data, *DRAFTER, "stage=dspark", f"checkpoint.init_from={backbone}", "trainer.max_steps=4",
                 "checkpoint.interval=2", "optim.lr=3e-3", "optim.warmup_steps=1", *extra)


@pytest.fixture(scope="module")
def drafted(tmp_path_factory, small_data, backbone):
    run = tmp_path_factory.mktemp("dspark")
    r = run_cli(_dspark(run, small_data, backbone))
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def _records(run: Path) -> list[dict]:
    return [r for r in read_metrics(run) if "loss" in r]


def test_every_record_carries_the_measured_and_the_predicted_acceptance_length(drafted):
    records = _records(drafted)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        for key in ("acceptance_len", "predicted_acceptance_len", "dspark/train_acceptance_len"):
            assert 1.0 <= r[key] <= K + 1, (key, r)
        assert all(math.isfinite(r[k]) and r[k] >= 0 for k in ("dspark/ce", "dspark/l1", "dspark/conf"))
        # the loss is the weighted terms' sum over the slots' weights
        assert r["loss"] == pytest.approx(0.1 * r["dspark/ce"] + 0.9 * r["dspark/l1"] + r["dspark/conf"], rel=1e-5)
    assert records[-1]["loss"] < records[0]["loss"]


def test_checkpoints_hold_the_drafter_alone_and_name_the_backbone(drafted, backbone):
    from torch.distributed.checkpoint import FileSystemReader

    from trainer.checkpoint import Checkpointer
    from trainer.checkpoint.loading import find_checkpoint, load_model, model_config, read_marker, run_tokenizer
    from trainer.stages.dspark import load_drafter

    ckpt = find_checkpoint(str(drafted))
    marker = Checkpointer.marker(ckpt)
    want_backbone = find_checkpoint(str(backbone)).resolve()
    assert marker["stage"] == "dspark" and Path(marker["backbone"]) == want_backbone
    keys = [k for k in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if k.startswith("train.model.")]
    tops = {k.split(".")[2] for k in keys}
    assert tops == {"main_proj", "main_norm", "layers", "norm", "markov_in", "markov_out", "confidence"}, tops
    # the engine's loader reads the pair back: the backbone the pretraining run saved, the drafter this run trained
    model, drafter = load_drafter(str(drafted), torch.device("cpu"))
    path = find_checkpoint(str(backbone))
    ref = load_model(path, model_config(read_marker(path)["model"], None, [], path), torch.device("cpu"),
                     run_tokenizer(path))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    assert not torch.equal(drafter.markov_out.weight, torch.zeros_like(drafter.markov_out.weight))  # trained


def test_a_resume_reproduces_the_uninterrupted_run(drafted, tmp_path, small_data, backbone):
    run = tmp_path / "resumed"
    shutil.copytree(drafted, run)
    shutil.rmtree(run / "checkpoints" / "step_00000004")  # as if killed after step 3's save window
    r = run_cli(_dspark(run, small_data, backbone))
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = _records(drafted), _records(run)
    assert [g["step"] for g in got] == [1, 2, 3, 4]
    for w, g in zip(want[2:], got[2:]):
        for key in ("loss", "grad_norm", "acceptance_len", "predicted_acceptance_len"):
            assert g[key] == pytest.approx(w[key], rel=1e-6), key


def test_no_gradient_reaches_the_backbone_and_it_stays_bit_identical(tmp_path, small_data, backbone):
    """The trainer's own loop, in this process: the backbone's parameters take no gradient and keep requires_grad
    off, its weights and buffers (MoE biases included) after two steps are the loaded ones bit for bit, it stays in
    eval mode; the drafter's weights move."""
    from trainer.config import to_config
    from trainer.compose import compose
    from trainer.train import build, train_loop

    args = _dspark(tmp_path, small_data, backbone, "trainer.max_steps=2", "checkpoint.interval=0")
    node = compose([a for a in args if not a.startswith("hydra.")])
    job = build(to_config(node), tmp_path)
    frozen = job.stage.backbone
    before = {k: v.clone() for k, v in frozen.state_dict(keep_vars=False).items()}
    buffers = {k: v.clone() for k, v in frozen.named_buffers()}
    drafter_before = {k: v.clone() for k, v in job.model.state_dict().items()}
    # a gradient that reached a backbone tensor would need requires_grad and would be accumulated into .grad
    assert not any(p.requires_grad for p in frozen.parameters())
    train_loop(job)
    job.metrics.close()
    assert job.state.step == 2
    assert all(p.grad is None for p in frozen.parameters())
    assert not frozen.training
    after = frozen.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(buffers[k], v) for k, v in frozen.named_buffers())
    moved = [k for k, v in job.model.state_dict().items() if not torch.equal(v, drafter_before[k])]
    assert "main_proj.weight" in moved and any(k.startswith("layers.") for k in moved)


def test_anchors_and_block_targets():
    from trainer.stages.dspark import block_targets, sample_anchors

    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 20, 11
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = torch.cat((ids[:, 1:], torch.full((B, 1), IGNORE_INDEX)), dim=1)
    labels[1, 5:9] = IGNORE_INDEX  # a masked span
    labels[2, :] = IGNORE_INDEX
    labels[2, 3] = ids[2, 4]  # one counting position
    logits = torch.randn(B, T, V, generator=g)
    anchors, ok = sample_anchors(labels, 6, K, g, whole_block=False)
    assert anchors.shape == (B, 6)
    for b in range(B):
        picked = anchors[b][ok[b]].tolist()
        assert len(set(picked)) == len(picked) and all(labels[b, a] != IGNORE_INDEX for a in picked)
    assert ok[2].sum() == 1 and anchors[2][ok[2]].item() == 3  # the only position that counts
    targets, valid, prev, tl = block_targets(ids, labels, logits, anchors, ok, K)
    for b in range(B):
        for i in range(6):
            a = int(anchors[b, i])
            n = 0  # the contiguous prefix of slots whose target exists and counts
            while ok[b, i] and n < K and a + n < T and labels[b, a + n] != IGNORE_INDEX:
                n += 1
            assert valid[b, i].tolist() == [k < n for k in range(K)]
            for k in range(n):
                assert targets[b, i, k] == labels[b, a + k] and prev[b, i, k] == ids[b, a + k]
                assert torch.equal(tl[b, i, k], logits[b, a + k])
    whole, wok = sample_anchors(labels, 6, K, g, whole_block=True)
    _, wvalid, _, _ = block_targets(ids, labels, logits, whole, wok, K)
    assert torch.equal(wvalid.all(-1), wok) and not wok[2].any()


@pytest.mark.parametrize("extra, message", [
    ([], "set checkpoint.init_from=<the backbone's checkpoint"),
    (["parallel.tp=2"], "parallel.tp=2 is not wired for the drafter"),
    (["stage.heldout_rows=4", "checkpoint.init_from=/nowhere"],
     "stage.heldout_rows=4 leaves no training row of data.batch_size=4"),
    (["checkpoint.init_from=/nowhere"], "checkpoint.init_from: '/nowhere' does not exist"),
], ids=["no-backbone", "tp", "heldout", "missing"])
def test_bad_starts_are_one_line(extra, message, tmp_path, small_data):
    r = run_cli(_args(tmp_path / "run", small_data, *DRAFTER, "stage=dspark", *extra))
    assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_a_drafter_checkpoint_is_not_a_backbone(tmp_path, small_data, drafted):
    r = run_cli(_dspark(tmp_path / "run", small_data, drafted))
    assert r.returncode != 0 and "is a drafter's checkpoint (stage dspark), not a backbone's" in r.stderr, \
        r.stderr[-2000:]


def test_generated_rows_continue_the_prefix_with_the_backbones_own_tokens():
    """stage.generated_rows at temperature 0: each generated row keeps its data prefix and every later token is the
    backbone's greedy choice after the tokens before it (its teacher-forced argmax); the other rows are untouched and
    every label of a generated row counts."""
    from types import SimpleNamespace

    from tests.helpers import build_tiny, load_config
    from trainer.stages.config import DSparkStageConfig
    from trainer.stages.dspark import DSparkStage

    # a cache that stores what the forward computes (no FP4 / FP8 formats): the engine's tokens are then exactly
    # the teacher-forced forward's argmax (the quantised cache's are those of the fp4_kv_qat forward)
    quant = dataclasses.replace(load_config("v41_tiny").quant, cache_main_kv="none", cache_index="none",
                                cache_swa_kv="none")
    backbone = build_tiny(seed=3, quant=quant).eval()
    stage = DSparkStage(DSparkStageConfig(generated_rows=2, generation_prefix=6, generation_temperature=0.0))
    stage.backbone = backbone
    stage.job = SimpleNamespace(trainer=SimpleNamespace(seed=0))
    g = torch.Generator().manual_seed(1)
    B, T, P = 3, 20, 6
    data = torch.randint(0, 4096, (B, T + 1), generator=g)
    ids, labels = data[:, :T], data[:, 1:].clone()
    labels[0, 3] = IGNORE_INDEX
    out_ids, out_labels = stage.generated_batch(ids, labels, step=1, index=0)
    assert torch.equal(out_ids[2], ids[2]) and torch.equal(out_labels[2], labels[2])
    assert torch.equal(out_ids[:2, :P], ids[:2, :P])
    assert torch.equal(out_labels[:2, :-1], out_ids[:2, 1:]) and (out_labels[:2] != IGNORE_INDEX).all()
    with torch.no_grad():
        greedy = backbone(out_ids[:2]).argmax(-1)  # [2, T]: the choice after each prefix
    assert torch.equal(out_labels[:2, P - 1:], greedy[:, P - 1:])
    assert not torch.equal(out_ids[:2], ids[:2])


def test_generate_with_the_drafter_returns_the_plain_greedy_text(drafted, backbone, tmp_path, capsys):
    """`python -m trainer.cli.generate ckpt=<backbone> drafter=<dspark run>`: the same greedy completions as without the
    drafter, the throughput line counting the drafts; a drafter of another model is refused, naming it."""
    from trainer.cli import generate

    # one thread, as the worker's share (tests/conftest.py); a fixed schedule: "auto" drafts only where its timings
    # say drafting pays, which on a loaded machine can be never
    base = [f"ckpt={backbone}", "prompt_template={prompt}", "prompt=def main(", "max_new_tokens=12", "num_threads=1"]

    def run(*extra: str) -> int:
        args, model_overrides = generate._hydra_arguments([*base, *extra])  # quoted as the command line quotes
        return generate.generate(generate.compose(args), model_overrides)

    texts = {}
    for name, extra in (("plain", []), ("spec", [f"drafter={drafted}", "spec_tokens=3", "spec_schedule=fixed"])):
        out = tmp_path / f"{name}.jsonl"
        assert run(*extra, f"output={out}") == 0
        texts[name] = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
        if name == "spec":
            assert "tokens per model forward" in capsys.readouterr().out
    assert texts["spec"] == texts["plain"] and len(texts["plain"][0]) == 12
    with pytest.raises(ValueError, match=r"drafter=.*a checkpoint of stage 'pretrain', not a DSpark run's"):
        run(f"drafter={backbone}")
