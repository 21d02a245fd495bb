#!/usr/bin/env bash
# GPU steps in one go. Each argument names a step; with none, every step runs:
#   tests       the GPU-only tests, a conformance subset (fp32 and bf16, forward and
#               backward), the capture, linear/slice/flash attention and MLP kernel tests, and
#               the training steps replayed as CUDA graphs
#   tests-device  every test file written to run on the machine's device (DEVICE or the
#               `device` fixture); the other files build CPU tensors for the interpreter, and on
#               a GPU machine those are not fused, so they are CI's only
#   bandwidth   benchmarks/bandwidth.py        (memory-bound kernels vs copy)
#   matmul      benchmarks/matmul.py           (products, MLPs, row-tiled chains)
#   attention   benchmarks/attention.py        (softmax, Galerkin, slice attention)
#   conv        benchmarks/conv.py             (U-Net / FNO convolutional blocks)
#   batch_norm_train  benchmarks/batch_norm_train.py  (batch norm in training + activation, forward and
#               backward: eager, the conv plugin's kernels, torch.compile)
#   mxint8      benchmarks/mxint8.py           (MXINT8 weights vs fp32)
#   fft         benchmarks/fft_plugin.py       (FNO / F-FNO with and without examples/autofuser-plugin-fft)
#   zoo:DTYPE:MODEL,MODEL   the zoo models through `autofuser bench` (benchmarks/zoo_run.sh), then
#               benchmarks/tuning_stats.py over their caches
#   train:DTYPE:MODEL,MODEL  their training steps (`autofuser bench --train`, flags in $TRAIN_FLAGS,
#               default --iters 30 --warmup 3 --tune-budget 1), each model in its own process
#   train-fill:DTYPE:MODELS then train-warm:DTYPE:MODELS  the same in less device time: the first
#               compiles every model's step into kept caches, $FILL_JOBS (default 3) at a time; the
#               second times them one by one on those caches (first steps warm, bench.md says so)
#   zoo-fill:DTYPE:MODELS then zoo-warm:DTYPE:MODELS  the same for zoo: (inference; flags in
#               $BENCH_FLAGS, default --iters 30 --warmup 5 --tune-budget 1)
#   dynamic:DTYPE  benchmarks/dynamic.py     (a zoo model on 50 point counts between 4k and 16k: first
#               calls and steady times against AutoFuser dynamic=False; flags in $DYNAMIC_FLAGS,
#               e.g. DYNAMIC_FLAGS="--model transformer --counts 20")
#   Every benchmark above goes through torch.compile in each mode of $COMPILE_MODES (default:
#   default,reduce-overhead; e.g. COMPILE_MODES=default,reduce-overhead,max-autotune), each mode
#   its own columns.
#   profile:DTYPE:MODEL,MODEL  benchmarks/profile_case.py on each model's training step, eager beside
#               AutoFuser: kernels by device time, and what each keeps allocated between steps
#               (--memory); flags in $PROFILE_FLAGS, e.g. PROFILE_FLAGS="--systems eager,autofuser,default"
#   profile-forward:DTYPE:MODEL,MODEL  the same for each model's forward, AutoFuser beside
#               torch.compile(mode="reduce-overhead"), both replayed
#   sdpa-probe  benchmarks/sdpa_grad_probe.py (each SDPA backend's gradients, in each layout of the
#               output's gradient, against float64; flags in $SDPA_PROBE_FLAGS)
#   ddp:DTYPE:MODEL,MODEL    DistributedDataParallel training (benchmarks/ddp_train.py, flags in
#               $DDP_FLAGS): one process standing in for every GPU's rank, then one rank per GPU
#               compared with it (gradients, parameters, scaling, tuning entries)
# Results (logs, JSON, markdown tables) go to ${OUT:-bench-results}/<step>.
# Extra flags for a benchmark script: ${STEP}_FLAGS, e.g. MATMUL_FLAGS="--widths 128".
# After every step, everything under the results folder is packed into one
# archive beside it, FOLDER.tar.gz: one file to copy off the machine, which
# still holds the finished steps when a time limit stops the run part-way.
set -uo pipefail
out=${OUT:-bench-results}
mkdir -p "$out"
export AUTOFUSER_CACHE_DIR=${AUTOFUSER_CACHE_DIR:-$(mktemp -d)}
export PYTHONUNBUFFERED=1
export ZOO_CACHE=${ZOO_CACHE:-/tmp/autofuser-zoo-cache}  # zoo_run.sh's per-model caches
export COMPILE_MODES=${COMPILE_MODES:-default,reduce-overhead}  # every benchmark's torch.compile modes
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
# Every zoo model, for a step's MODELS of "all".
ZOO_MODELS=galerkin,transformer,transolver,transolver2d,gnot,factformer,fno,ffno,unet,lsm,ufno,upt
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests bandwidth matmul attention conv mxint8 fft "zoo:fp32:all")

for step in "${steps[@]}"; do
  start=$(date +%s)
  case "$step" in
    tests)
      # A few minutes: the CUDA tests, each lowering's first sample forward and backward, the
      # attention and MLP kernels (tests-device runs every device test, about 15 minutes).
      python3 -m pytest -q -p no:cacheprovider tests/core/test_capture.py tests/integration/test_cuda.py \
        tests/integration/test_conformance.py tests/integration/test_conformance_backward.py \
        tests/plugins/attention/test_linear_attention.py tests/plugins/attention/test_slice_attention.py \
        tests/plugins/attention/test_flash.py tests/plugins/conv/test_batch_norm_train.py \
        tests/plugins/matmul/test_mlp_persistent.py tests/integration/test_training_graphs.py \
        -k "not float16 and (sample0-form0 or sample0] or test_capture or test_cuda or persistent or attention or graph or test_batch_norm_train)" \
        > "$out/tests.log" 2>&1
      echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests.log" | tail -n 40 ;;
    tests-device)
      python3 -m pytest -q -p no:cacheprovider tests/integration/test_cuda.py tests/core/test_capture.py \
        tests/integration/test_conformance.py tests/integration/test_conformance_backward.py \
        tests/plugins/elementwise/test_elementwise_ops.py \
        tests/plugins/attention/test_attention.py tests/plugins/attention/test_linear_attention.py \
        tests/plugins/attention/test_slice_attention.py tests/plugins/attention/test_flash.py \
        tests/plugins/conv/test_batch_norm_train.py \
        tests/plugins/matmul/test_mlp_persistent.py tests/integration/test_training_graphs.py \
        > "$out/tests-device.log" 2>&1
      echo "tests-device rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/tests-device.log" | tail -n 40 ;;
    bandwidth|matmul|attention|conv|mxint8|batch_norm_train)
      flags_var="${step^^}_FLAGS"
      mkdir -p "$out/$step"
      # shellcheck disable=SC2086
      python3 "benchmarks/$step.py" --out "$out/$step" --compile-modes "$COMPILE_MODES" ${!flags_var:-} \
        > "$out/$step.log" 2>&1
      echo "$step rc=$?"; tail -n 40 "$out/$step.log" ;;
    fft)
      # The plugin is its own distribution; nothing outside the machine is reachable, hence no deps/isolation.
      python3 -m pip install -q --no-deps --no-build-isolation ./examples/autofuser-plugin-fft 2>&1 | tail -n 3
      mkdir -p "$out/fft"
      # shellcheck disable=SC2086
      python3 benchmarks/fft_plugin.py --out "$out/fft" --compile-modes "$COMPILE_MODES" ${FFT_FLAGS:-} \
        > "$out/fft.log" 2>&1
      echo "fft rc=$?"; tail -n 20 "$out/fft.log" ;;
    dynamic:*)
      dtype=${step#dynamic:}
      # Each system in a process of its own, with empty AutoFuser, Triton and Inductor caches.
      # shellcheck disable=SC2086
      python3 benchmarks/dynamic.py --out "$out/dynamic-$dtype" --dtype "$dtype" --compile-modes "$COMPILE_MODES" \
        ${DYNAMIC_FLAGS:-} > "$out/dynamic-$dtype.log" 2>&1
      echo "dynamic:$dtype rc=$?"; tail -n 20 "$out/dynamic-$dtype.log" ;;
    zoo:*)
      IFS=: read -r _ dtype models <<< "$step"
      [ "$models" = "all" ] && models=$ZOO_MODELS
      # shellcheck disable=SC2046
      OUT="$out/zoo" ZOO_CACHE="$ZOO_CACHE/$dtype" bash benchmarks/zoo_run.sh "$dtype" $(tr , ' ' <<< "$models")
      # Where each kernel's tuning winner sat in its config list (the caches zoo_run.sh filled).
      python3 benchmarks/tuning_stats.py "$ZOO_CACHE/$dtype"/* --json "$out/zoo/tuning-$dtype.json" \
        > "$out/zoo/tuning-stats-$dtype.txt" 2>&1 ;;
    train:*)
      IFS=: read -r _ dtype models <<< "$step"
      [ "$models" = "all" ] && models=$ZOO_MODELS
      # shellcheck disable=SC2046
      OUT="$out/train" ZOO_CACHE="$ZOO_CACHE/train-$dtype" BENCH_FLAGS="--train ${TRAIN_FLAGS:---iters 30 --warmup 3 --tune-budget 1}" \
        bash benchmarks/zoo_run.sh "$dtype" $(tr , ' ' <<< "$models") ;;
    train-fill:*|train-warm:*|zoo-fill:*|zoo-warm:*)
      # The whole zoo in less device time: train-fill (zoo-fill) compiles every model's step
      # (forward), $FILL_JOBS (default 3) at a time, into caches kept under $ZOO_CACHE
      # (AutoFuser's, Triton's, Inductor's; its cold first calls are taken on a shared GPU: not
      # for the tables); train-warm (zoo-warm) then times the models one by one on those
      # caches, as train: (zoo:) does (its first calls are warm ones, bench.md says so). Run
      # both on one machine, in one call or in calls close enough that it stays warm.
      IFS=: read -r kind dtype models <<< "$step"
      [ "$models" = "all" ] && models=$ZOO_MODELS
      phase=${kind%-*} what=${kind#*-}
      if [ "$phase" = train ]; then
        timed="--train ${TRAIN_FLAGS:---iters 30 --warmup 3 --tune-budget 1}" fill="--train --iters 2 --warmup 1"
        cache_name="train-$dtype"
      else
        timed="${BENCH_FLAGS:---iters 30 --warmup 5 --tune-budget 1}" fill="--iters 2 --warmup 1"
        cache_name="$dtype"
      fi
      if [ "$what" = fill ]; then
        where="$out/$phase-fill" flags="$fill --tune-budget 1" jobs=${FILL_JOBS:-3}
      else
        where="$out/$phase" flags="$timed" jobs=1
      fi
      # shellcheck disable=SC2046
      OUT="$where" ZOO_CACHE="$ZOO_CACHE/$cache_name" ZOO_KEEP_CACHES="$ZOO_CACHE/compilers-$cache_name" \
        ZOO_JOBS="$jobs" BENCH_FLAGS="$flags" bash benchmarks/zoo_run.sh "$dtype" $(tr , ' ' <<< "$models") ;;
    sdpa-probe)
      # shellcheck disable=SC2086
      python3 benchmarks/sdpa_grad_probe.py ${SDPA_PROBE_FLAGS:-} > "$out/sdpa-probe.log" 2>&1
      echo "sdpa-probe rc=$?"; grep -v '^\[' "$out/sdpa-probe.log" | tail -n 30 ;;
    profile:*|profile-forward:*)
      IFS=: read -r kind dtype models <<< "$step"
      mkdir -p "$out/$kind"
      if [ "$kind" = profile ]; then
        what=(--train --memory --systems eager,autofuser)
      else
        what=(--systems autofuser,reduce-overhead)
      fi
      for model in $(tr , ' ' <<< "$models"); do
        # shellcheck disable=SC2086
        python3 benchmarks/profile_case.py --zoo "$model" --dtype "$dtype" "${what[@]}" --calls 10 --warmup 5 \
          ${PROFILE_FLAGS:-} --out "$out/$kind/$model-$dtype.md" > "$out/$kind/$model-$dtype.log" 2>&1
        echo "$kind $model $dtype rc=$?"
      done ;;
    ddp:*)
      IFS=: read -r _ dtype models <<< "$step"
      [ "$models" = "all" ] && models=galerkin,transformer,transolver,transolver2d,gnot,factformer,fno,ffno,unet,lsm
      gpus=$(nvidia-smi -L | wc -l)
      dir="$out/ddp-$dtype"
      flags=(--models "$models" --dtype "$dtype" --cache-dir "$AUTOFUSER_CACHE_DIR/ddp")
      # shellcheck disable=SC2086
      python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/ddp_train.py "${flags[@]}" \
        --accumulate "$gpus" --out "$dir/one-process" ${DDP_FLAGS:-} > "$dir-one-process.log" 2>&1
      echo "ddp one process rc=$?"
      # shellcheck disable=SC2086
      python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" benchmarks/ddp_train.py "${flags[@]}" \
        --baseline "$dir/one-process" --delay-rank1-s 5 --out "$dir/ranks" ${DDP_FLAGS:-} > "$dir.log" 2>&1
      echo "ddp $gpus ranks rc=$?"; tail -n 12 "$dir.log"
      # The saved parameters served the comparison; they would make the archive hundreds of MB.
      rm -rf "$dir"/*/params ;;
    *) echo "unknown step $step" ;;
  esac
  echo "step $step took $(( $(date +%s) - start )) s" | tee -a "$out/steps.txt"
  tar -czf "$out.tar.gz" -C "$(dirname "$out")" "$(basename "$out")"
done
echo "archive: $out.tar.gz"
