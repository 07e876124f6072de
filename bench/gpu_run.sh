# Sourced by the one-call device scripts (bench/gpu_fast_paths.sh, bench/gpu_rollouts.sh, bench/gpu_kept_graphs.sh):
# OUT_DIR from $1, the repository as the working directory, and `run`.
out=${1:?usage: bash $0 OUT_DIR}
mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
run() {  # run NAME SECONDS CMD...: CMD's output into OUT_DIR/NAME.txt, its exit status (124: cut) on the last line
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "exit $? (124: cut at ${limit} s)" >> "$out/$name.txt"
}
