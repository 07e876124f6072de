# Two commands do all set-up: `make train` and `make test`. Both create .venv when it is missing.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.cedar-installed

.PHONY: train test venv bench clean pipeline

$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	@# On a machine without a GPU, install the CPU build of torch first (served from local disk here).
	@if ! command -v nvidia-smi >/dev/null 2>&1 && ! $(VPY) -c "import torch" >/dev/null 2>&1; then \
		$(VPY) -m pip install -q torch==2.13.0; fi
	$(VPY) -m pip install -q -e '.[test]'
	@# The code environments' sandbox (data/envs/sandbox.py) needs bubblewrap: installed here when missing, as root.
	@if ! command -v bwrap >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; fi
	@touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	$(VPY) -m trainer.cli.main $(ARGS)

# pretrain -> SFT -> RL -> on-policy distillation -> DSpark drafter on v41_tiny (trainer/cli/stage_chain.py), a run
# directory per stage under runs/pipeline/, then a table of each stage's headline figure, wall time and checkpoint.
# PIPELINE_ARGS: the runner's own options (`make pipeline PIPELINE_ARGS="--scale 0.5 --root runs/x"`); ARGS:
# overrides for every stage.
pipeline: $(STAMP)
	$(VPY) -m trainer.cli.stage_chain $(PIPELINE_ARGS) -- $(ARGS)

# Two pytest workers (pytest-xdist), each test file whole on one worker (its module fixtures built once): the tiny
# models leave a core idle most of the time, so two workers on the CI's two cores take 844 s where one took 1,304.
# Each worker runs one torch thread (tests/conftest.py: two threads each oversubscribed the cores) and gets the
# longest files first.
# TEST_WORKERS=0 runs in this process (e.g. `make test TEST_WORKERS=0 PYTEST_ARGS="tests/model -x"`).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench: $(STAMP)
	$(VPY) bench/cpu_step.py

# What the project writes: run directories (runs/: every run's checkpoints, metrics and W&B files; Hydra's sweeps
# under runs/multirun/), Hydra's own default run and sweep directories, top-level wandb/ and checkpoints/, the
# Slurm logs of launch/slurm.sbatch, pytest's cache and Python's bytecode. Kept: the virtual environment ($(VENV))
# and the prepared data (.data/, slow to rebuild).
clean:
	rm -rf runs outputs multirun wandb checkpoints .pytest_cache
	rm -f slurm-*.out
	find . -path ./$(VENV) -prune -o -path ./.git -prune -o -path ./.data -prune -o \
		-name __pycache__ -type d -prune -exec rm -rf {} +
