"""`python -m trainer.cli.generate` (trainer/cli/generate.py): completions from a checkpoint of any layout, in one process.

- From the run directory of a 2-step v41_tiny training, the CLI's greedy tokens (two prompts of different lengths
  in one batch, read from a prompts_file, written as JSONL; the cache's quantisation switched off on the command line,
  on top of the checkpoint's config) are the teacher-forced argmax of the model that training's own resume path
  loads, and the weights and balancing biases the CLI loads are that model's, bit for bit.
- Checkpoints written by two ranks (dp_shard 2: FSDP2 shards; tp 2: DTensor shards) of known weights load into the
  single process as those weights exactly, and the CLI's greedy tokens equal the engine's on them.
- Bad input is one `error:` line, exit status 2: a missing, incomplete or corrupt checkpoint, a model that differs
  from the checkpoint's (`model=<option>` or `model.<key>=`), a checkpoint without a recorded config, a prompts_file
  line that is not JSON (named by its number), an empty prompt, a prompt too long for max_len.
- Prompt text reaches the model verbatim (no Hydra quoting), and stop strings cut the completion where they complete.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.fork_server import run_module
from tests.distributed import run_distributed
from tests.helpers import every_role_config
from tests.trainer.harness import QUIET, REPO, SMALL_DATA, env, run_cli
from trainer.cli import generate
from trainer.engine import Completion, Engine, PromptFormat, Request, SamplingParams

EXACT_CACHE = ["model.quant.cache_main_kv=none", "model.quant.cache_index=none", "model.quant.cache_swa_kv=none"]
PROMPTS = ["def fib(n):", "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):"]
LAYOUTS = {"dp_shard2": dict(dp_shard=2), "tp2": dict(tp=2)}
SEED = 3


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The models of this file are tiny: one thread each, which a busy 2-core machine runs far faster than two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, small_data):
    run = tmp_path_factory.mktemp("gen") / "run"
    r = run_cli([f"hydra.run.dir={run}", f"data.path={small_data}", *SMALL_DATA, *QUIET, "trainer.max_steps=2",
                 "data.batch_size=2"])
    assert r.returncode == 0, r.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def tokenizer(small_data):
    from data.tokenizer import load_tokenizer

    return load_tokenizer(str(small_data / "tokenizer.json"))


def _main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """trainer.cli.generate's main in this process: (exit status, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["trainer.cli.generate"])
    try:
        generate.main([*args, "num_threads=1"])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _training_model(path: Path, tokenizer_path: str) -> torch.nn.Module:
    """The single-process model as training's resume path loads it (trainer/train.py build, checkpoint.load)."""
    from optim import LRScheduler, OptimConfig, build_optimizer
    from trainer.checkpoint import Checkpointer, TrainState
    from trainer.config import CheckpointConfig, ParallelConfig, TrainerConfig
    from trainer.train import build_model, install_canonical_vocab, setup_runtime

    marker = Checkpointer.marker(path)
    cfg = generate.model_config(marker["model"], None, [], path)
    rt = setup_runtime(TrainerConfig(device="cpu", precision="fp32", num_threads=1), ParallelConfig())
    pm = build_model(cfg, rt, ParallelConfig(), 0, batch_size=1, seq_len=32, grad_accum=1)
    install_canonical_vocab(pm.module, cfg, tokenizer_path)
    optim_cfg = OptimConfig(**marker["optim"])
    optimizer = build_optimizer(list(pm.module.parameters()), optim_cfg)
    state = TrainState(pm.module, optimizer, LRScheduler(optimizer, optim_cfg, total_steps=marker["max_steps"]))
    Checkpointer(path.parent, CheckpointConfig()).load(path, {"train": state})
    return pm.module.eval()


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    assert torch.equal(a.hasher.canonical_map, b.hasher.canonical_map)  # not in the checkpoint: from the tokenizer


def test_greedy_tokens_from_a_run_dir_are_the_trained_models_argmax(run_dir, small_data, tokenizer, tmp_path):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(PROMPTS)))
    r = run_module("trainer.cli.generate", [f"ckpt={run_dir}", f"prompts_file={prompts}", f"output={out}",
                                            "max_new_tokens=8", "num_threads=1", *EXACT_CACHE],
                   cwd=REPO, env=env(), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tokens/s" in r.stdout and r.stderr == ""
    assert r.stdout.rstrip().endswith("; CPU threads 1 (set)")  # the throughput line says the threads
    records = [json.loads(line) for line in out.read_text().split("\n") if line]
    assert [rec["id"] for rec in records] == [0, 1]

    path = run_dir / "checkpoints" / "step_00000002"
    tok_path = str(small_data / "tokenizer.json")
    trained = _training_model(path, tok_path)
    loaded = generate.load_model(path, trained.cfg, torch.device("cpu"), tok_path)
    _assert_same_state(loaded, trained)
    for rec, prompt in zip(records, PROMPTS):
        ids = tokenizer.encode(PromptFormat().render(prompt, 100)).ids
        assert rec["num_prompt_tokens"] == len(ids) and rec["text"] == tokenizer.decode(rec["token_ids"])
        n, toks = len(ids), rec["token_ids"]
        assert len(toks) == 8 or rec["finish_reason"] == "stop"
        with torch.no_grad():
            logits = trained(torch.tensor([ids + toks]))[0]
        assert logits[n - 1:-1].argmax(-1).tolist() == toks


# --- checkpoints of two ranks ---------------------------------------------------------------------------------------
def _perturb(module: torch.nn.Module) -> None:
    """Move every weight and balancing bias off its initial value by an amount fixed by its name (any layout)."""
    biases = [(n, b) for n, b in module.named_buffers() if n.endswith(("gate.bias", "gate.bias_image"))]
    with torch.no_grad():
        for name, t in [*module.named_parameters(), *biases]:
            k = zlib.crc32(name.encode()) % 7
            t.mul_(0.85 + 0.05 * k).add_(0.01 * (k - 3))


def _build(fields: dict):
    from trainer.config import ParallelConfig, TrainerConfig
    from trainer.train import build_model, setup_runtime

    parallel = ParallelConfig(**fields)
    rt = setup_runtime(TrainerConfig(device="cpu", precision="fp32", num_threads=1), parallel)
    pm = build_model(every_role_config(), rt, parallel, SEED, batch_size=1, seq_len=24, grad_accum=1)
    _perturb(pm.module)
    return rt, pm


def _save_layouts(rank: int, world: int, root: str) -> None:
    """Each layout of LAYOUTS saves its model as a training run does (Job.save_checkpoint's entries)."""
    from optim import LRScheduler, OptimConfig, build_optimizer
    from trainer.checkpoint import Checkpointer, TrainState
    from trainer.config import CheckpointConfig

    for name, fields in LAYOUTS.items():
        rt, pm = _build(fields)
        optimizer = build_optimizer(list(pm.module.parameters()), OptimConfig())
        state = TrainState(pm.module, optimizer, LRScheduler(optimizer, OptimConfig(), total_steps=1))
        info = {"model": dataclasses.asdict(every_role_config()), "layout": dataclasses.asdict(rt.dims)}
        checkpointer = Checkpointer(Path(root) / name / "checkpoints", CheckpointConfig(), rt.rank, info=info)
        checkpointer.save(1, {"train": state})


def _single() -> torch.nn.Module:
    return _build({})[1].module.eval()


def test_a_checkpoint_of_two_ranks_loads_as_the_same_weights(small_data, tokenizer, tmp_path, monkeypatch, capsys):
    _, reference = run_distributed(_save_layouts, 2, str(tmp_path), meanwhile=_single)
    tok_path = str(small_data / "tokenizer.json")
    from trainer.train import install_canonical_vocab

    install_canonical_vocab(reference, reference.cfg, tok_path)
    prompt = "for key, value in items:"
    ids = tokenizer.encode(PromptFormat().render(prompt, 100)).ids
    eos = tokenizer.token_to_id("<eos>")
    want = Engine(reference).generate([Request(ids, SamplingParams(temperature=0, max_new_tokens=6,
                                                                   stop_token_ids=[eos]))])[0]
    for name in LAYOUTS:
        path = tmp_path / name / "checkpoints" / "step_00000001"
        _assert_same_state(generate.load_model(path, reference.cfg, torch.device("cpu"), tok_path), reference)
        # a checkpoint outside a run directory: the tokenizer is given
        code, out, err = _main(monkeypatch, capsys, f"ckpt={tmp_path / name}", f"tokenizer={tok_path}",
                               f"prompt={prompt}", "max_new_tokens=6")
        assert code == 0, err
        lines = out.split("\n")  # a header, the prompt and the completion under their labels, the throughput, ""
        assert lines[0] == f"--- 1: {len(want.token_ids)} tokens, {want.finish_reason}", name
        assert "\n".join(lines[1:-2]) == f"[prompt]\n{prompt}\n[completion]\n{tokenizer.decode(want.token_ids)}", name
        assert "tokens/s" in lines[-2]


# --- one-line errors ------------------------------------------------------------------------------------------------
def _copy(step: Path, dest: Path, marker=None) -> Path:
    """A copy of checkpoint `step` at dest (its data files linked), optionally with another marker."""
    dest.mkdir(parents=True)
    for f in step.iterdir():
        if f.name == "COMPLETE" and marker is not None:
            (dest / f.name).write_text(json.dumps(marker))
        elif f.name.endswith(".distcp"):
            (dest / f.name).symlink_to(f)
        else:
            shutil.copy(f, dest / f.name)
    return dest


def _error_cases(run_dir: Path, tmp: Path, tok_path: str) -> dict[str, tuple[list[str], str]]:
    step = run_dir / "checkpoints" / "step_00000002"
    incomplete = _copy(step, tmp / "incomplete" / "checkpoints" / "step_00000002")
    (incomplete / "COMPLETE").unlink()
    corrupt = _copy(step, tmp / "corrupt" / "checkpoints" / "step_00000002")
    data = bytearray((corrupt / ".metadata").read_bytes())
    data[len(data) // 2] ^= 1
    (corrupt / ".metadata").write_bytes(bytes(data))
    marker = json.loads((step / "COMPLETE").read_text())
    del marker["model"]
    unrecorded = _copy(step, tmp / "format1" / "checkpoints" / "step_00000002", marker)
    (tmp / "bad.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b",}\n')
    (tmp / "empty.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": ""}\n')
    ok = [f"ckpt={run_dir}", "prompt=x"]
    return {
        "missing": ([f"ckpt={tmp / 'nope'}", "prompt=x"], "does not exist"),
        "incomplete run": ([f"ckpt={tmp / 'incomplete'}", "prompt=x"], "holds no complete checkpoint"),
        "incomplete step": ([f"ckpt={incomplete}", "prompt=x"], "is not a complete checkpoint: it has no COMPLETE"),
        "corrupt": ([f"ckpt={tmp / 'corrupt'}", "prompt=x"], "is corrupt: .metadata does not match its sha256"),
        "model option": ([*ok, "model=v41_small"], "was saved with another model: model.attention.head_dim=64 there, "
                                                   "256 here;"),
        "model key": ([*ok, "model.dim=64"], "was saved with another model: model.dim=128 there, 64 here."),
        "no config": ([f"ckpt={unrecorded}", "prompt=x", f"tokenizer={tok_path}"], "records no model config"),
        "bad json": ([f"ckpt={run_dir}", f"prompts_file={tmp / 'bad.jsonl'}"], "bad.jsonl' line 2 is not valid JSON"),
        "empty prompt": ([f"ckpt={run_dir}", "prompt="], "prompt is empty"),
        "empty line": ([f"ckpt={run_dir}", f"prompts_file={tmp / 'empty.jsonl'}"], "line 3: the prompt is empty"),
        "too long": ([*ok, "max_len=16", "max_new_tokens=12"], "prompt: 8 prompt tokens (rendered with "
                                                               "prompt_template) + max_new_tokens=12 = 20 exceed "
                                                               "max_len=16"),
        "bad value": ([*ok, "max_new_tokens=many"], "max_new_tokens: Value 'many' of type 'str' could not be "
                                                    "converted to Integer"),
        "misspelled key": ([*ok, "max_new_tokenz=3"], "unknown key max_new_tokenz (did you mean max_new_tokens?)"),
    }


def test_bad_input_is_one_line(run_dir, small_data, tmp_path, monkeypatch, capsys):
    for name, (args, message) in _error_cases(run_dir, tmp_path, str(small_data / "tokenizer.json")).items():
        code, out, err = _main(monkeypatch, capsys, *args)
        assert code == 2 and out == "", (name, out, err)
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, (name, err)


# --- prompts and stop strings ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["def f(a, b=[1]):", "it's ${x} \\ 'q'\n\tend\\", "{prompt} = {'k': 1}"])
def test_prompt_text_is_taken_verbatim(text):
    args, model_overrides = generate._hydra_arguments(["ckpt=x", f"prompt={text}", "model.dim=8"])
    assert model_overrides == ["model.dim=8"]  # without model=<option>: for the checkpoint's config
    cfg = generate.compose(args)
    assert cfg.prompt == text and cfg.model is None


def test_stop_strings_cut_where_they_complete(tokenizer):
    ids = tokenizer.encode("x = 1\n\ny = 2\n").ids
    c = Completion("r", [5], token_ids=list(ids), logprobs=[0.0] * len(ids), model_logprobs=[0.0] * len(ids),
                   text=tokenizer.decode(ids))
    generate.cut_at_stop_strings(c, ["y =", "\n\n"], tokenizer)
    assert c.text == "x = 1" and c.finish_reason == "stop"
    assert "\n\n" in tokenizer.decode(c.token_ids) and "\n\n" not in tokenizer.decode(c.token_ids[:-1])
    assert len(c.logprobs) == len(c.model_logprobs) == len(c.token_ids)


def test_default_prompts_are_the_chat_templates_and_stop_at_end(tokenizer):
    """With the default prompt_template a prompt is encoded as SFT and RL encode a user turn (a prompt spelling a
    marker stays text) and <|end|> stops it; the raw template tokenizes the text whole and has no <|end|> stop."""
    from data.chat import ChatTemplate

    template = ChatTemplate(tokenizer)
    texts = ["5+0", "say <|end|> and stop"]
    prompts = [generate.Prompt(t, "prompt", i, 20, SamplingParams(max_new_tokens=4), []) for i, t in enumerate(texts)]
    cfg = generate.GenerateConfig(ckpt="x", prompt="unused")
    requests = generate.to_requests(prompts, tokenizer, 1, cfg, generate.chat_template(tokenizer, cfg))
    for r, text in zip(requests, texts):
        assert r.prompt == template.render_prompt(text, 20)
        assert r.prompt.count(template.end_id) == 1  # the user turn's closing marker only
        assert r.sampling.stop_token_ids == [1, template.end_id]
    no_end = dataclasses.replace(cfg, stop_at_end=False)
    assert generate.to_requests(prompts, tokenizer, 1, no_end, template)[0].sampling.stop_token_ids == [1]
    raw_cfg = dataclasses.replace(cfg, prompt_template="{prompt}")
    assert generate.chat_template(tokenizer, raw_cfg) is None
    raw = generate.to_requests(prompts, tokenizer, 1, raw_cfg, None)
    assert [r.prompt for r in raw] == [tokenizer.encode(t).ids for t in texts]
    assert all(r.sampling.stop_token_ids == [1] for r in raw)


def test_a_completion_is_printed_apart_from_its_prompt():
    """`7+2` answered `8` reads as two labelled texts, not `7+28`."""
    c = SimpleNamespace(request_id=3, token_ids=[5, 6], finish_reason="stop", text="8")
    assert generate.shown(c, "7+2") == "--- 3: 2 tokens, stop\n[prompt]\n7+2\n[completion]\n8"
