"""Proves the float wire (trainer/parallel/pipeline.py `_FLOAT_WIRE`, on for torch < 2.13: torch 2.11's
PipelineStage cannot receive integer tensors; the carriers are trainer/parallel/pipeline_wire.py's) is exact, on
whichever torch runs the tests.

- Every non-floating slot dtype the stages ship (int32 ids, int64 Engram rows, uint8 bit-packed masks, dead / image
  masks and KV dtype codes; bool and int16 for completeness) survives `to_carrier` -> `from_carrier` bit for bit at
  awkward widths, including int32 / int64 patterns that are NaNs (-1, the empty-place id, among them) or
  denormals as floats, after a byte copy as the transports make; the carrier shapes are the metadata's.
- The stage metadata (PipelineStage's input / output examples) declares each integer slot of a cut as a float32
  carrier that requires grad under the float wire, and as boundary_slots says without it.

The rest of what it proves: docs/testing.md#the-float-wire
"""

from __future__ import annotations

import traceback

import pytest
import torch

from tests.distributed import run_distributed
from tests.parallel.test_pp import _check, _config, _one_thread, _pp_train, single_run  # noqa: F401
from trainer.config import ParallelDims
from trainer.parallel import pipeline
from trainer.parallel.mesh import build_mesh
from trainer.parallel.pipeline_wire import _carrier_shape, boundary_slots, from_carrier, to_carrier

SCHEDULES = ("1F1B", "ZBVZeroBubble")


# --- the carrier round trip -----------------------------------------------------------------------------------------

def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.int16])
@pytest.mark.parametrize("width", [0, 1, 2, 3, 5, 8, 13])
def test_carrier_round_trip_is_bit_exact(dtype, width):
    gen = torch.Generator().manual_seed(width)
    shape = (2, 3, width)
    if dtype == torch.bool:
        t = torch.rand(shape, generator=gen) < 0.5
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)
    if dtype == torch.int32 and width:
        # as floats: NaN (-1 = 0xffffffff, the empty-place id, and a quiet NaN), +inf, -0.0, a denormal
        special = torch.tensor([-1, 0x7FC00001, 0x7F800000, -(2 ** 31), 1], dtype=torch.int32)
        t.view(-1)[:5] = special[: t.numel()] if t.numel() < 5 else special
    if dtype == torch.int64 and width:
        t[0, 0, 0] = -1  # both halves NaN patterns
    carrier = to_carrier(t)
    assert carrier.dtype == torch.float32 and tuple(carrier.shape) == _carrier_shape(shape, dtype)
    assert carrier.is_contiguous()
    sent = torch.empty_like(carrier).copy_(carrier)  # what a transport does: a byte copy
    back = from_carrier(sent.requires_grad_(), shape, dtype)
    assert back.dtype == dtype and tuple(back.shape) == shape and not back.requires_grad
    assert torch.equal(_bits(back), _bits(t))


def test_int32_ids_that_are_nans_survive():
    ids = torch.tensor([[-1, 0x7FC00000, 0x7FFFFFFF, -2, 5]], dtype=torch.int32)
    carrier = to_carrier(ids)
    assert carrier.isnan().sum() == 4  # -1, the quiet NaN, 0x7fffffff, -2 (0xfffffffe)
    assert torch.equal(from_carrier(carrier.clone(), (1, 5), torch.int32), ids)


def test_every_slot_of_a_cut_has_a_float_carrier_in_the_metadata(monkeypatch):
    """The cut in front of layer 7 ships a top-k, the pool, Engram rows and the dead mask; with the float wire
    forced on, both stages' metadata declare each as a float32 carrier requiring grad, and the float slots as
    before; with it off, the integer slots are what boundary_slots says."""
    import model as model_pkg

    slots = boundary_slots(_config(), 7, 1, 32)
    assert {s.dtype for s in slots} >= {torch.uint8, torch.int64}  # integer slots do cross
    for wire in (True, False):
        monkeypatch.setattr(pipeline, "_FLOAT_WIRE", wire)
        with torch.device("meta"):
            model = model_pkg.build(_config())
        stages = pipeline.split_model(model, [7], [0, 1])
        for stage in stages:
            stage.set_shapes(1, 32)
        expected = [(_carrier_shape(s.shape, s.dtype), torch.float32, True) if wire and not s.dtype.is_floating_point
                    else (s.shape, s.dtype, s.grad) for s in slots]
        for metas in (stages[0].example_outputs(), stages[1].example_inputs()):
            assert [(tuple(m.shape), m.dtype, m.requires_grad) for m in metas] == expected, wire


# --- pp 2 with the float wire forced on -----------------------------------------------------------------------------

RUNS = {"1F1B": (1, [7]), "ZBVZeroBubble": (2, [2, 6, 9])}


def _worker(rank: int, world: int) -> dict:
    import tests.parallel.test_pp as test_pp
    from trainer.parallel import zero_bubble

    pipeline._FLOAT_WIRE = True  # spawned: the parent's monkeypatch would not reach this process
    test_pp.RUNS = {**test_pp.RUNS, **RUNS}
    input_grads: list = []  # every input gradient a non-first stage hands back

    original = zero_bubble.ZeroBubbleStage.backward_maybe_with_nosync

    def recorded(self, backward_type, bwd_kwargs, last_backward=False):
        grads, state = original(self, backward_type, bwd_kwargs, last_backward)
        if backward_type != "weight" and not self.is_first:
            input_grads.extend(grads)
        return grads, state

    zero_bubble.ZeroBubbleStage.backward_maybe_with_nosync = recorded
    meshes = build_mesh(ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=world, ep=1, cp=1), "cpu")
    results = {}
    for schedule in SCHEDULES:
        input_grads.clear()
        try:
            results[schedule] = _pp_train(rank, world, meshes, schedule)
            results[schedule]["input_grads"] = (len(input_grads), sum(g is None for g in input_grads))
        except Exception:
            results[schedule] = traceback.format_exc()
            break
    return results


@pytest.fixture(scope="module")
def single():
    return single_run()


@pytest.fixture(scope="module")
def float_wire_runs():
    runs, _ = run_distributed(_worker, 2, meanwhile=single_run)  # the reference (once, test_pp's) while they run
    return runs


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_on_the_float_wire_matches_single_process(float_wire_runs, single, schedule):
    assert _check(float_wire_runs, single, schedule) == RUNS[schedule][1]
    counts = [r[schedule]["input_grads"] for r in float_wire_runs]
    assert sum(n for n, _ in counts) > 0 and all(none == 0 for _, none in counts), counts
