#!/usr/bin/env bash
# One device call for what session 24 left to measure: the RL rollout's prefill grouped by prompt on the kernels
# (bench/rollout_prefill.py), an RL step of v41_small at issue 40's shape with the engine's fast paths
# (bench/rl_rollout.py), and Cedar's FP8 linear against torchao's (bench/fp8_libraries.py; carry torchao's wheel
# in .whl), each under its own time limit.
#
#   bash bench/gpu_rollouts.sh OUT_DIR
#
# Writes OUT_DIR/prefill.txt, rl.txt, fp8_libraries.txt (and a .jsonl beside each).
set -uo pipefail
source "$(dirname "$0")/gpu_run.sh"
run prefill 90 python3 bench/rollout_prefill.py --model v41_small --device cuda --prompts 8 --group 8 \
  --prompt-len 40 --json "$out/prefill.jsonl"
run rl 330 python3 bench/rl_rollout.py --prompts 64 --group 8 --new-tokens 256 --steps 2 \
  --modes graph+triton,graph --timeout 160 --root /tmp/bench_rl_rollout --json "$out/rl.jsonl"
run fp8_libraries 150 python3 bench/fp8_libraries.py --json "$out/fp8_libraries.jsonl"
