#!/usr/bin/env bash
# One device call for what session 26 left to measure (issue 40): the engine's CUDA-graph tests with kept graphs
# (a second batch replays the kept graph), an RL step of v41_small at the issue's shape (64 prompts x 8, 256 new
# tokens) with the kept graphs on the serving kernels, and the compiled kernel step at 128K context (the 128K / 4K
# ratio of the compiled step), each under its own time limit. The RL step with the compiled step (compiling takes
# ~3 min a batch size) is a second call's: `python3 bench/rl_rollout.py --modes compiled+graph+triton --timeout 540`.
#
#   bash bench/gpu_kept_graphs.sh OUT_DIR
#
# Writes OUT_DIR/engine_tests.txt, rl.txt, decode_128k.txt (and a .jsonl beside the benchmarks').
set -uo pipefail
source "$(dirname "$0")/gpu_run.sh"
run engine_tests 90 python3 -m pytest -q -p no:cacheprovider tests/trainer/test_engine.py -k "cuda_graph or pool"
run rl 220 python3 bench/rl_rollout.py --prompts 64 --group 8 --new-tokens 256 --steps 2 \
  --modes graph+triton --timeout 210 --root /tmp/bench_rl_rollout --json "$out/rl.jsonl"
run decode_128k 170 python3 bench/decode_kernels.py --model v41_small --context 131072 --batch-sizes 32 --steps 6 \
  --check-steps 1 --no-count --modes static,graph+kernels,compiled+kernels --json "$out/decode_128k.jsonl"
