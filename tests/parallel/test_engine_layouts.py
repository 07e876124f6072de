"""The generation engine under the trainer's layouts (rollouts colocated with training): each data rank generates
its own requests, different in number and length from its peer's, so the ranks make different numbers of model
calls and the engine's lockstep pairs them (tp peers are one data rank: they pass the same requests) (trainer/engine/engine.py). Every completion equals the single process's
on the same requests: the same greedy tokens, the same log-probs within rounding.

One spawn of 2 ranks runs dp_shard 2 (FSDP2: every call all-gathers the weights), tp 2 (heads split; without
sequence parallelism) and ep 2 (the experts' all-to-all); pipeline, context and sequence parallelism are refused
with a message naming them."""

from __future__ import annotations

import dataclasses
import traceback

import pytest
import torch

from tests.distributed import run_distributed
from tests.helpers import every_role_config
from trainer.config import ParallelConfig, TrainerConfig
from trainer.engine import Engine, Request, SamplingParams
from trainer.train import build_model, setup_runtime

LAYOUTS = {"dp_shard2": dict(dp_shard=2), "tp2": dict(tp=2), "ep2": dict(ep=2)}
SEED = 0


def _config():
    cfg = every_role_config()
    q = dataclasses.replace(cfg.quant, cache_main_kv="none", cache_index="none", cache_swa_kv="none")
    return dataclasses.replace(cfg, quant=q)


def _requests(rank: int) -> list[Request]:
    gen = torch.Generator().manual_seed(10 + rank)
    lengths = [(7, 9), (19, 4), (12, 6)] if rank == 0 else [(25, 11)]
    return [Request(torch.randint(0, 4096, (n,), generator=gen).tolist(),
                    SamplingParams(temperature=0, max_new_tokens=k), request_id=(rank, i))
            for i, (n, k) in enumerate(lengths)]


def _generate(fields: dict, rank: int) -> list:
    parallel = ParallelConfig(**fields)
    rt = setup_runtime(TrainerConfig(device="cpu", precision="fp32", num_threads=1), parallel)
    pm = build_model(_config(), rt, parallel, SEED, batch_size=1, seq_len=24, grad_accum=1)
    pm.module.eval()
    eng = Engine(pm, replay="halo", max_batch=2)
    # a data rank's requests: tp peers are one data rank and pass the same ones
    data_rank = rank if rt.meshes is None else rt.meshes.data.get_local_rank()
    return [(c.request_id, c.token_ids, c.model_logprobs) for c in eng.generate(_requests(data_rank))]


def _worker(rank: int, world: int) -> dict:
    out = {}
    for name, fields in LAYOUTS.items():
        try:
            out[name] = _generate(fields, rank)
        except Exception:
            out[name] = traceback.format_exc()
            break
    return out


@pytest.fixture(scope="module")
def single():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {r: _generate({}, r) for r in (0, 1)}
    finally:
        torch.set_num_threads(threads)


def test_engine_under_dp_tp_ep_equals_the_single_process(single):
    ranks = run_distributed(_worker, 2)
    for name in LAYOUTS:
        for rank, got in enumerate(ranks):
            assert not isinstance(got[name], str), f"{name} rank {rank}:\n{got[name]}"
            data_rank = 0 if name == "tp2" else rank
            assert len(got[name]) == len(single[data_rank])
            for (rid, toks, lps), (rid0, toks0, lps0) in zip(got[name], single[data_rank]):
                assert rid == rid0 and toks == toks0, f"{name} rank {rank} request {rid}"
                torch.testing.assert_close(torch.tensor(lps), torch.tensor(lps0), rtol=0, atol=1e-4)


def test_engine_refuses_pipeline_context_and_sequence_parallel_models():
    from trainer.engine import serving_module
    from trainer.parallel.apply import ParallelModel

    pm = build_model(_config(), setup_runtime(TrainerConfig(device="cpu", precision="fp32"), ParallelConfig()),
                     ParallelConfig(), SEED, batch_size=1, seq_len=24, grad_accum=1)
    assert serving_module(pm) is pm.module
    for dims, match in (((1, 1, 1, 2, 1, 1), "pipeline parallelism \\(parallel.pp=2\\)"),
                        ((1, 1, 1, 1, 1, 2), "context parallelism \\(parallel.cp=2\\)")):
        with pytest.raises(ValueError, match=match):
            serving_module(dataclasses.replace(pm, dims=type(pm.dims)(*dims)))
    with pytest.raises(ValueError, match="sequence_parallel=true"):
        serving_module(dataclasses.replace(pm, sequence_parallel=True))
    assert isinstance(pm, ParallelModel)
