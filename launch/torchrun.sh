#!/usr/bin/env bash
# One node, N processes:  launch/torchrun.sh N [hydra overrides...]
#   e.g. launch/torchrun.sh 4 model=v41_tiny trainer.max_steps=100
# Every argument after N is a Hydra override, passed unchanged to each rank's `python -m trainer.cli.main`.
set -euo pipefail

if [[ $# -lt 1 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 NUM_PROCESSES [hydra overrides...]" >&2
  exit 2
fi
NPROC=$1
shift

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
[[ -x $PY ]] || PY=python3

# All ranks must write to one run directory; Hydra's ${now:...} could differ by a second between ranks, so
# it is fixed here. A hydra.run.dir=... among the overrides comes later on the command line and wins.
RUN_DIR=runs/$(date +%Y-%m-%d_%H-%M-%S)

cd "$REPO"
# The trainer's start-up checks against NPROC processes first: a layout that does not fit is one line, before
# torchrun starts (instead of every rank's error and torchrun's failure report).
"$PY" -m trainer.cli.preflight "$NPROC" "$@" || exit $?
exec "$PY" -m trainer.cli.torchrun --standalone --nnodes=1 --nproc_per_node="$NPROC" \
  -m trainer.cli.main "hydra.run.dir=$RUN_DIR" "$@"
