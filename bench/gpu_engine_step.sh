#!/usr/bin/env bash
# One device call for issues 40 and 41: the engine's CUDA tests, the decode step op by op / from a CUDA graph /
# compiled by Inductor inside a CUDA graph (kernels per step counted), and the training step at the flagship's widths
# (conf/model/v41_proxy.yaml) with its dense peer.
#
#   bash bench/gpu_engine_step.sh OUT_DIR PHASE [SECONDS]   PHASE: tests | decode | step | engine-tests | decode-4k
#
# engine-tests: the compiled and CUDA-graph engine tests alone; decode-4k: the decode benchmark at 4K context alone.
# The step runs with full activation checkpointing on a GPU under 100 GB (the planner puts v41_proxy's step at 93 GB
# without, 69 GB with); AC=none|full overrides; PEER=0 skips the dense peer. PEER=moe runs instead v41_small's step
# (4 x 2048 tokens, compiled + fused loss) and its MoE peer at the same batch (bench/moe_peer_step.py), and prints
# Cedar / MoE peer in MFU against the matmul rate measured in each process (issue 41's ratio).
# Writes OUT_DIR/PHASE.txt (and PHASE.jsonl where the benchmark emits rows).
set -uo pipefail
out=${1:?usage: bench/gpu_engine_step.sh OUT_DIR PHASE [SECONDS]}
phase=${2:?phase: tests | decode | step}
limit=${3:-300}
mkdir -p "$out"
cd "$(dirname "$0")/.."
case "$phase" in
  tests)
    timeout "$limit" python3 -m pytest -q -rf -p no:cacheprovider --tb=short tests/trainer/test_engine.py \
      tests/model/test_cache.py tests/model/test_cache_rollback.py tests/trainer/test_hf_reference.py \
      > "$out/tests.txt" 2>&1
    echo "pytest exit $? (124: cut at ${limit} s)" >> "$out/tests.txt" ;;
  engine-tests)
    timeout "$limit" python3 -m pytest -q -rf -p no:cacheprovider --tb=short tests/trainer/test_engine.py \
      -k "compiled or cuda_graph" > "$out/tests.txt" 2>&1
    echo "pytest exit $? (124: cut at ${limit} s)" >> "$out/tests.txt" ;;
  decode-4k)
    timeout "$limit" python3 bench/generation.py batch --device cuda --model v41_small --context 4096 \
      --batch-sizes 1,32 --step static,graph,compiled --steps 20 --count-kernels --json "$out/decode.jsonl" \
      > "$out/decode.txt" 2>&1
    echo "generation exit $?" >> "$out/decode.txt" ;;
  decode)
    {
      timeout "$limit" python3 bench/generation.py batch --device cuda --model v41_small --context 4096 \
        --batch-sizes 1,32 --step static,graph,compiled --steps 20 --count-kernels --json "$out/decode.jsonl"
      echo "generation exit $?"
      timeout "$limit" python3 bench/generation.py batch --device cuda --model v41_small --context 131072 \
        --batch-sizes 32 --step graph,compiled --steps 10 --json "$out/decode.jsonl"
      echo "generation exit $?"
    } > "$out/decode.txt" 2>&1 ;;
  step)
    if [ "${PEER:-1}" = moe ]; then
      {
        timeout "$limit" python3 bench/profile_step.py --model v41_small --batch-size 4 --seq-len 2048 \
          --modes compiled+fused --json "$out/step.jsonl"
        echo "profile_step exit $?"
        timeout "$limit" python3 bench/moe_peer_step.py --match v41_small --batch-size 4 --seq-len 2048 \
          --steps 10 --warmup 3 --json "$out/step.jsonl"
        echo "moe_peer_step exit $?"
        python3 - "$out/step.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
cedar = [r["mfu_measured"] for r in rows if r["model"] == "v41_small" and "mfu_measured" in r]
peer = [r["mfu_measured"] for r in rows if r["model"] == "MoE peer of v41_small"]
if cedar and peer:
    print(f"Cedar / MoE peer (MFU against each process's measured bf16 matmul rate): {cedar[-1] / peer[-1]:.2f}")
PY
      } > "$out/step.txt" 2>&1
      exit 0
    fi
    mem=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory // 2**30)")
    ac=${AC:-$( (( mem < 100 )) && echo full || echo none )}
    {
      timeout "$limit" python3 bench/profile_step.py --model v41_proxy --batch-size 1 --seq-len 4096 \
        --modes compiled+fused --steps 3 --warmup 3 --top 20 --activation-checkpoint "$ac" \
        --json "$out/step.jsonl"
      echo "profile_step exit $?"
      [ "${PEER:-1}" = 1 ] || exit 0
      timeout 200 python3 bench/peer_step.py --match v41_proxy --dim 5120 --heads 40 --ffn 13824 --batch-size 1 \
        --seq-len 4096 --steps 10 --json "$out/step.jsonl"
      echo "peer_step exit $?"
    } > "$out/step.txt" 2>&1 ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
