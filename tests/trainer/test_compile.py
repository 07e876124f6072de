"""trainer.compile: every block compiles whole (fullgraph: a graph break fails) and trains as the eager model does.

The model is tests/helpers.py's every-role config (SWA, encoder Full + Reuse, the decoder Full that builds the
candidate pool, Reuse, the pool-restricted Reindex, Engram): every branch a block takes in training. aot_eager traces
forward and backward as inductor does, without generating code (inductor's C++ compilation of six blocks takes
minutes on two cores; bench/profile_step.py measures it); fp32 on CPU, the reference kernels.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from tests.helpers import EVERY_ROLE_SEQ_LEN, every_role_config
from trainer.config import ParallelConfig, TrainerConfig
from trainer.parallel.compile import compile_blocks, is_compiled
from trainer.train import build_model, forward_backward, setup_runtime

LAYERS = 6


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch._dynamo.reset()


def _config():
    cfg = every_role_config()
    # the sequence-balance loss on: its scatter-add and the counts' fixed-size bins are in the graph too
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, seq_aux_loss_coef=1e-2))


def _batches(step: int) -> list[dict]:
    gen = torch.Generator().manual_seed(10 + step)
    ids = torch.randint(0, 4096, (2, EVERY_ROLE_SEQ_LEN + 1), generator=gen)
    labels = ids[:, 1:].clone()
    labels[0, :5] = -100
    return [{"input_ids": ids[:, :-1], "labels": labels}]


def _run(backend, activation_checkpoint: str = "none", steps: int = 2) -> dict:
    parallel = ParallelConfig(activation_checkpoint=activation_checkpoint)
    rt = setup_runtime(TrainerConfig(device="cpu", precision="fp32", num_threads=1), parallel)
    pm = build_model(_config(), rt, parallel, 0, batch_size=2, seq_len=EVERY_ROLE_SEQ_LEN, grad_accum=1,
                     compile_backend=backend)
    pm.module.train()
    out = {"loss": [], "grads": [], "aux": [], "frames": [], "names": [n for n, _ in pm.module.named_parameters()]}
    for step in range(steps):
        micro = forward_backward(pm, _batches(step), None)
        out["loss"].append(micro.loss)
        out["aux"].append(micro.aux)
        out["grads"].append({n: p.grad.clone() for n, p in pm.module.named_parameters() if p.grad is not None})
        for p in pm.module.parameters():
            p.grad = None
        if isinstance(backend, CompileCounterWithBackend):
            out["frames"].append(backend.frame_count)
    out["compiled"] = [is_compiled(b) for b in pm.module.layers]
    return out


def _assert_same(got: dict, want: dict, tol: float) -> None:
    assert got["names"] == want["names"]  # no wrapper module: parameter names (and checkpoints) unchanged
    for step in range(len(want["loss"])):
        assert got["loss"][step] == pytest.approx(want["loss"][step], rel=tol)
        assert got["aux"][step].keys() == want["aux"][step].keys()
        for k, v in want["aux"][step].items():
            # a KL is a difference of cross-entropies of order log(entries): its rounding is relative to them
            floor = tol * math.log(EVERY_ROLE_SEQ_LEN) if k.endswith("_kl") else 1e-9
            assert got["aux"][step][k] == pytest.approx(v, rel=tol, abs=floor), k
        g, w = got["grads"][step], want["grads"][step]
        assert g.keys() == w.keys()
        total = torch.sqrt(sum(t.double().square().sum() for t in w.values()))
        worst = max(float((g[n] - t).double().norm() / total) for n, t in w.items())
        assert worst < tol, f"step {step + 1}: a gradient differs by {worst:.2e} of the whole gradient's norm"


def test_every_block_compiles_whole_and_trains_as_eager():
    eager = _run(None)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = _run(counter)
    assert compiled["compiled"] == [True] * LAYERS
    # one graph per block (fullgraph: a break would have raised), none more at the second step: no recompilation
    assert compiled["frames"] == [LAYERS, LAYERS]
    assert counter.op_count > 100 * LAYERS  # the blocks' operators are in the graphs, not run around them
    _assert_same(compiled, eager, 1e-5)


def test_compiled_blocks_under_activation_checkpointing():
    """The checkpointed forward is what is compiled: the recomputation is traced with it (Dynamo's checkpoint
    operator), still one graph per block."""
    eager = _run(None, "full", steps=1)
    counter = CompileCounterWithBackend("eager")
    compiled = _run(counter, "full", steps=1)
    assert compiled["frames"] == [LAYERS]
    _assert_same(compiled, eager, 1e-6)


def test_blocks_of_one_role_share_a_graph():
    """A block's graph is guarded on what it computes (role, sources, Engram, whether pre_prev carries a gradient),
    not on its layer index: two Reuse blocks reading the same sources run one graph. (Each block its own graph made
    v41_small's compile 24 graphs, 400 s on an H200.) Layers: 0-1 SWA (0's pre_prev is the constant first pre),
    2 Full, 3 Reuse, 4 decoder Full, 5-6 Reuse <- 4, 7 Reuse <- 4 with Engram: 7 graphs for 8 blocks."""
    cfg = every_role_config()
    cfg = dataclasses.replace(
        cfg, num_layers=8, num_encoder_layers=4, engram=dataclasses.replace(cfg.engram, layers=[7]),
        csa2=dataclasses.replace(cfg.csa2, compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1], kv_source_layers=[2, 4],
                                 index_source_layers=[2, 4], candidate_source_layer=4))
    parallel = ParallelConfig()
    rt = setup_runtime(TrainerConfig(device="cpu", precision="fp32", num_threads=1), parallel)
    counter = CompileCounterWithBackend("eager")
    pm = build_model(cfg, rt, parallel, 0, batch_size=2, seq_len=EVERY_ROLE_SEQ_LEN, grad_accum=1,
                     compile_backend=counter)
    pm.module.train()
    forward_backward(pm, _batches(0), None)
    assert counter.frame_count == 7


def test_compile_blocks_is_idempotent():
    parallel = ParallelConfig()
    rt = setup_runtime(TrainerConfig(device="cpu", precision="fp32", num_threads=1), parallel)
    pm = build_model(_config(), rt, parallel, 0, batch_size=2, seq_len=EVERY_ROLE_SEQ_LEN, grad_accum=1,
                     compile_backend="eager")
    keys = list(pm.module.state_dict())
    assert compile_blocks(pm.module, "eager") == 0  # already compiled: nothing wrapped twice
    assert list(pm.module.state_dict()) == keys and not any("_orig_mod" in k for k in keys)


def test_cudagraph_mode_marks_each_micro_batch(monkeypatch):
    """trainer.compile_mode=reduce-overhead (CUDA graphs, measured on an H200: BENCHMARKS.md, issue 16): each
    micro-batch's forward begins a new generation of the graph trees; a model compiled in the default mode, none."""
    import trainer.parallel.compile as compile_module
    import trainer.train as train_module

    parallel = ParallelConfig()
    rt = setup_runtime(TrainerConfig(device="cpu", precision="fp32", num_threads=1), parallel)
    # torch.compile is lazy: nothing is compiled until a block runs, and the blocks do not run here
    graphs = build_model(_config(), rt, parallel, 0, batch_size=2, seq_len=EVERY_ROLE_SEQ_LEN, grad_accum=1,
                         compile_backend="inductor", compile_mode="reduce-overhead")
    plain = build_model(_config(), rt, parallel, 0, batch_size=2, seq_len=EVERY_ROLE_SEQ_LEN, grad_accum=1,
                        compile_backend="inductor")
    begun = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: begun.append(1))
    compile_module.mark_step(graphs.module)
    compile_module.mark_step(plain.module)
    assert begun == [1]

    seen = []
    monkeypatch.setattr(train_module, "mark_step", lambda module: seen.append(module))
    eager = build_model(_config(), rt, parallel, 0, batch_size=2, seq_len=EVERY_ROLE_SEQ_LEN, grad_accum=2)
    forward_backward(eager, _batches(0) + _batches(1), None)
    assert seen == [eager.module, eager.module]


def test_cudagraph_mode_refuses_what_it_cannot_replay():
    """CUDA graphs read fixed addresses and one generation's outputs: a second micro-batch (its replay overwrites
    the outputs the first one's .grad came from), FSDP (re-gathered parameters) and a pipeline are refused by name,
    before anything is built on the device; a compile mode of another backend fails in the config."""
    parallel = ParallelConfig()
    rt = setup_runtime(TrainerConfig(device="cpu", precision="fp32", num_threads=1), parallel)
    with pytest.raises(ValueError, match="trainer.grad_accum=2"):
        build_model(_config(), rt, parallel, 0, batch_size=2, seq_len=EVERY_ROLE_SEQ_LEN, grad_accum=2,
                    compile_backend="inductor", compile_mode="reduce-overhead")
    with pytest.raises(ValueError, match="trainer.compile_mode=reduce-overhead is a mode of the inductor backend"):
        TrainerConfig(compile=True, compile_backend="aot_eager", compile_mode="reduce-overhead")
    with pytest.raises(ValueError, match="compile_mode"):
        TrainerConfig(compile_mode="fast")
    with pytest.raises(ValueError, match="not of 'eager'"):
        compile_blocks(torch.nn.Module(), "eager", mode="max-autotune")


def test_a_compiled_run_says_before_its_first_step_that_it_compiles(tmp_path, small_data):
    """Issue 44: `trainer.compile=true` on the CPU printed nothing for 8 minutes after 'parallel layout' (23 on a
    loaded machine), then an ETA of hours: the start-up now says what the first step does, before it starts. The
    eager backend keeps the run short; the line is the same for every backend."""
    from tests.trainer.harness import micro_overrides, run_cli

    r = run_cli(micro_overrides(tmp_path, small_data, "trainer.max_steps=2", "trainer.compile=true",
                                "trainer.compile_backend=eager", "checkpoint.interval=0"))
    assert r.returncode == 0, r.stderr[-2000:]
    log = (tmp_path / "main.log").read_text()
    line = ("trainer.compile: 4 blocks are compiled by torch.compile (eager) during the first step, and again for a "
            "new input shape (an evaluation's): minutes on a CPU")
    assert line in log and log.index(line) < log.index("step 1/2")
