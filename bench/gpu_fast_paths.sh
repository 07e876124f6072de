#!/usr/bin/env bash
# One device call for the fast paths of issues 40 and 41: their CUDA tests, then the decode step on the serving
# kernels (bench/decode_kernels.py), the sparse attention backward's variants (bench/kernels.py), the FP8 GEMMs
# (bench/fp8_gemm.py) and the prefill on the training kernels (bench/generation.py prefill-kernels), each under its
# own time limit so that one slow part leaves the others their time.
#
#   bash bench/gpu_fast_paths.sh OUT_DIR
#
# Writes OUT_DIR/tests.txt, decode.txt, sa_bwd.txt, fp8.txt, prefill.txt (and a .jsonl beside each benchmark).
set -uo pipefail
source "$(dirname "$0")/gpu_run.sh"
run tests 150 python3 -m pytest -q -rf -p no:cacheprovider --tb=line tests/kernels/test_sparse_decode.py \
  tests/kernels/test_indexer_decode.py tests/model/test_serving_decode.py tests/model/test_prefill.py \
  tests/trainer/test_engine.py tests/optim/test_clip_in_step.py tests/kernels/test_fp8_gemm.py \
  tests/kernels/test_sparse_attention.py
run decode 110 python3 bench/decode_kernels.py --model v41_small --context 4096 --batch-sizes 1,32 --steps 10 \
  --json "$out/decode.jsonl"
run sa_bwd 110 python3 bench/kernels.py --only sparse_attention/bwd --json "$out/sa_bwd.jsonl"
run fp8 80 python3 bench/fp8_gemm.py --json "$out/fp8.jsonl"
run prefill 120 python3 bench/generation.py prefill-kernels --device cuda --model v41_small --prompt-len 8192 \
  --repeats 2 --replays none,window --json "$out/prefill.jsonl"
