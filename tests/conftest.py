"""Session-wide test set-up, in the root conftest, which pytest imports first:
- on a machine without a GPU, Triton kernels run in the interpreter (set before any module decorates a kernel);
- under pytest-xdist each worker, and every process it starts (OMP_NUM_THREADS is inherited), takes an equal share
  of the cores: torch's default of one thread per core in each of two workers on two cores oversubscribes them, and
  OpenMP's waiting threads then cost far more than they compute (the cache tests ran 5x slower).
Tests that pin their own thread count (the reference curve: trainer.num_threads=2) keep it."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    _share = max(1, len(os.sched_getaffinity(0)) // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_share)
    torch.set_num_threads(_share)

# The suite's longest files (seconds of one worker, `--durations` of a full run on the CI's two cores), sent to the
# workers first: pytest-xdist's --dist loadfile hands out whole files in collection order, so a long file collected
# last would run alone at the end while the other worker sits idle.
_LONGEST_FIRST = (
    "trainer/test_stages.py", "trainer/test_train.py", "trainer/test_stage_layouts.py", "parallel/test_layouts.py",
    "model/test_kernels_switch.py", "trainer/test_reference_curve.py", "trainer/test_checkpoint.py",
    "parallel/test_tp.py", "trainer/test_compile.py", "parallel/test_compile_layouts.py", "parallel/test_reshard.py",
    "parallel/test_engram_trainer.py", "model/test_cache.py", "trainer/test_grpo.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}

    def key(item):
        path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
        return rank.get(path, len(rank))

    items.sort(key=key)  # stable: the other files, and the tests inside each file, keep their order


@pytest.fixture(autouse=True)
def _thread_share_kept():
    """An app run in-process (generate, evaluate, a training) sets torch's threads for its process (trainer/threads.py:
    the cores it may use): the worker's share is put back after the test, so later tests in the worker do not run
    oversubscribed."""
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)
