#!/usr/bin/env bash
# Zoo models one by one on the GPU, each in its own process with a time limit, so
# one slow or failing model still leaves the others' results.
# Usage: OUT=dir bash benchmarks/zoo_run.sh DTYPE MODEL [MODEL...]
# Extra `autofuser bench` flags go in $BENCH_FLAGS (default: --iters 30 --warmup 5 --tune-budget 1);
# with --train among them it times training steps (give it its own OUT: the folders are named alike).
# AutoFuser's per-model caches in $ZOO_CACHE (default /tmp/autofuser-zoo-cache).
# torch.compile's modes in $COMPILE_MODES (default: default,reduce-overhead - each its own columns;
# add max-autotune to measure it too, with a longer $MODEL_LIMIT_S).
# $ZOO_KEEP_CACHES (a folder): keep Triton's and Inductor's caches there, one pair per model and
# dtype, and pass --keep-cache, so a later run on them times first calls on warm caches (each
# compiler's); without it every model starts on empty caches.
# $ZOO_JOBS (default 1): models run that many at a time, to fill caches (their times are then
# taken on a shared GPU: for filling caches, not for the tables).
set -uo pipefail
out=${OUT:-bench-results}
dtype=$1; shift
flags=${BENCH_FLAGS:---iters 30 --warmup 5 --tune-budget 1}
modes=${COMPILE_MODES:-default,reduce-overhead}
limit=${MODEL_LIMIT_S:-300}  # two torch.compile modes, each compiling once
cache=${ZOO_CACHE:-/tmp/autofuser-zoo-cache}  # AutoFuser's cache folders, one per model
jobs=${ZOO_JOBS:-1}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
one_model() {
  local model=$1 dir="$out/$1-$dtype" caches keep=()
  if [ -n "${ZOO_KEEP_CACHES:-}" ]; then
    caches="$ZOO_KEEP_CACHES/$model-$dtype"; keep=(--keep-cache); mkdir -p "$caches"
  else
    # Cold means cold for both compilers: Triton's and Inductor's on-disk caches start
    # empty for each model, so no model reuses binaries another step left behind.
    caches=$(mktemp -d)
  fi
  # shellcheck disable=SC2086
  TRITON_CACHE_DIR="$caches/triton" TORCHINDUCTOR_CACHE_DIR="$caches/inductor" \
  timeout "$limit" python3 -m autofuser.cli bench --models "$model" --device cuda --dtype "$dtype" \
    --out "$dir" --cache-dir "$cache" --compile-modes "$modes" "${keep[@]}" $flags > "$dir.log" 2>&1
  echo "$model $dtype rc=$?" | tee -a "$out/summary.txt"
  [ -n "${ZOO_KEEP_CACHES:-}" ] || rm -rf "$caches"
  tail -n 3 "$dir.log"
}
for model in "$@"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
  one_model "$model" &
done
wait
