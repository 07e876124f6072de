"""trainer.compile under the layouts: FSDP2 (dp_shard 2), tensor parallelism (tp 2) and expert parallelism with the
sync-free all-to-all (ep 2, parallel.ep_capacity_factor=2: fixed-size buffers that never drop a token) compile every
block whole (fullgraph: a graph break raises) and train as the single process does, within test_layouts.py's
tolerances (its harness, model, batches and reference).

The backend is Dynamo's capture alone ("eager"): what a layout adds to a block's graph is captured there (DTensor
parameters read through `model.common.local`, FSDP's unsharded parameters as graph inputs, the functional all-to-alls
of the sync-free dispatcher), while the hooks (FSDP's unshard, tp's layouts) stay outside it. aot_eager's forward and
backward tracing of the same blocks is tests/trainer/test_compile.py's (one process) and
tests/parallel/test_ep_sync_free.py's (the ep dispatcher). The dropless ep dispatcher reads its split sizes on the host
and does break the graph: trainer.compile under ep wants the sync-free one.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.parallel import test_layouts as layouts

LAYOUTS = {
    "dp_shard2": dict(dp_shard=2),
    "tp2": dict(tp=2),
    "ep2_sync_free": dict(ep=2, ep_capacity_factor=2.0),
}


def _train(name: str) -> dict:
    import torch

    torch._dynamo.reset()
    return layouts._train_small(LAYOUTS[name], compile_backend="eager")


def _worker(rank: int, world: int, names: list[str]) -> dict:
    return layouts.train_each(names, _train)


_RUNS: list = []


def _runs() -> list:
    if not _RUNS:
        _RUNS.append(run_distributed(_worker, 2, list(LAYOUTS)))
    return _RUNS[0]


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_layouts_match_single_process(name, single_small):
    layouts._check(name, [r[name] if name in r else f"{name} did not run" for r in _runs()], single_small)


@pytest.fixture(scope="module")
def single_small():
    return layouts.single_small_run()
