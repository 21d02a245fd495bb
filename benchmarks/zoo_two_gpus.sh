#!/usr/bin/env bash
# The zoo in fp32 and in bf16 side by side on a host with two GPUs: each dtype's
# benchmarks/gpu_run.sh zoo steps on one GPU, pinned to half the host's physical cores
# (both hyperthreads of a core go to the same half), so the two runs' compiles don't
# share cores. Each run's AutoFuser, Triton and Inductor caches are its own.
# Two independent single-GPU runs; one model trained on both GPUs (DistributedDataParallel)
# is benchmarks/ddp_train.py (gpu_run.sh's ddp step).
# Usage: OUT=dir bash benchmarks/zoo_two_gpus.sh [MODEL,MODEL...]   (default: all eleven)
# Extra `autofuser bench` flags in $BENCH_FLAGS, as for zoo_run.sh.
set -uo pipefail
out=${OUT:-bench-results}
models=${1:-galerkin,transformer,factformer,transolver,gnot,fno,ffno,unet,lsm,ufno,upt}
mkdir -p "$out"
{ lscpu; nvidia-smi topo -m; } > "$out/host.txt" 2>&1
# Halves by physical core: logical CPUs of the lower half of the core ids, then the rest.
read -r lower upper < <(python3 - <<'PY'
import subprocess
rows = [line.split(",") for line in subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET"], capture_output=True,
                                                  text=True).stdout.splitlines() if not line.startswith("#")]
cores = sorted({(int(s), int(c)) for _, c, s in rows})
half = set(cores[: len(cores) // 2])
lower = [cpu for cpu, c, s in rows if (int(s), int(c)) in half]
upper = [cpu for cpu, c, s in rows if (int(s), int(c)) not in half]
print(",".join(lower), ",".join(upper))
PY
)
if [ -z "${lower:-}" ] || [ -z "${upper:-}" ]; then
  echo "zoo_two_gpus.sh: could not split the host's cores in two (lscpu -p gave: ${lower:-nothing} / ${upper:-nothing})" >&2
  exit 2
fi
echo "fp32 on GPU 0, CPUs $lower; bf16 on GPU 1, CPUs $upper" | tee "$out/split.txt"
# Up to three steps per dtype, so each step's archive holds what finished if a time limit stops the run.
steps() { IFS=, read -r -a m <<< "$models"; local n=${#m[@]} a=$(( (${#m[@]} + 2) / 3 ));
  for ((i = 0; i < n; i += a)); do echo "zoo:$1:$(IFS=,; echo "${m[*]:i:a}")"; done; }
# shellcheck disable=SC2046
CUDA_VISIBLE_DEVICES=0 ZOO_CACHE=/tmp/autofuser-zoo-cache-0 OUT="$out/fp32" \
  taskset -c "$lower" bash benchmarks/gpu_run.sh $(steps fp32) > "$out/fp32.log" 2>&1 &
# shellcheck disable=SC2046
CUDA_VISIBLE_DEVICES=1 ZOO_CACHE=/tmp/autofuser-zoo-cache-1 OUT="$out/bf16" \
  taskset -c "$upper" bash benchmarks/gpu_run.sh $(steps bf16) > "$out/bf16.log" 2>&1 &
wait
tail -n 5 "$out/fp32.log" "$out/bf16.log"
