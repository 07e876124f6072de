#!/usr/bin/env bash
# One device call that checks and times the kernels: the CUDA test run of the kernels and the model's kernel switch,
# and bench/kernels.py's default cases (`bench/kernels.py --sweep` times the tile sweeps), then bench/generation.py
# on v41_small (cache bytes, CED prefill, decode at short and long context, batch 1 vs 32). Two GPUs: the tests run
# on GPU 0 beside the benchmarks on GPU 1; one GPU: one after the other, so the three limits must fit the device
# call together (e.g. 250 150 180).
#
#   bash bench/gpu_suite.sh OUT_DIR [TEST_SECONDS] [BENCH_SECONDS] [GEN_SECONDS]   (GEN_SECONDS 0: no generation)
#
# Writes into OUT_DIR (the device tool brings back only a few): tests.txt (pytest's summary with every failure's
# assertion), kernels.jsonl (one line per timed case, as it is timed), kernels.txt (the table), generation.jsonl
# and generation.txt (likewise).
set -uo pipefail
out=${1:?usage: bench/gpu_suite.sh OUT_DIR [TEST_SECONDS] [BENCH_SECONDS] [GEN_SECONDS]}
test_s=${2:-330}
bench_s=${3:-330}
gen_s=${4:-240}
mkdir -p "$out"
cd "$(dirname "$0")/.."
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
bench_gpu=$(( gpus > 1 ? 1 : 0 ))
run_tests() {
  CUDA_VISIBLE_DEVICES=0 timeout "$test_s" python3 -m pytest -q -rf -p no:cacheprovider --tb=line \
    tests/kernels tests/model/test_kernels_switch.py tests/model/test_norm_rope_wiring.py > "$out/tests.full" 2>&1
  echo "pytest exit $? (124: cut at ${test_s} s)" >> "$out/tests.full"
  grep -v '^[.sFExX]*\( *\[ *[0-9]*%\]\)\?$' "$out/tests.full" | tail -n 200 > "$out/tests.txt"
  rm -f "$out/tests.full"
}
run_bench() {
  CUDA_VISIBLE_DEVICES=$bench_gpu timeout "$bench_s" python3 bench/kernels.py --json "$out/kernels.jsonl" \
    > "$out/kernels.txt" 2>&1
  (( gen_s > 0 )) || return 0
  CUDA_VISIBLE_DEVICES=$bench_gpu timeout "$gen_s" python3 bench/generation.py all --device cuda --model v41_small \
    --models v41_flash,v41_small --prompt-len 8192 --repeats 3 --short 4096 --long 1048576 --chunk 2048 \
    --context 4096,65536 --profile --json "$out/generation.jsonl" > "$out/generation.txt" 2>&1
  echo "generation exit $? (124: cut at ${gen_s} s)" >> "$out/generation.txt"
}
if (( gpus > 1 )); then
  run_tests & run_bench; wait
else
  run_tests; run_bench
fi
