#!/usr/bin/env bash
# One call on the GPU machine: build the extension (incrementally, in the ignored build/ folder),
# run the GPU tests, run the benchmark. Logs go to $OUT (the device tool's result folder) or
# ./gpu_logs. Usage: scripts/gpu_check.sh [build|test|grid|bench|sanitize|profile|all]
#   A wheel in .whl-h100/ (scripts/build_h100_wheel.sh, carried) replaces the build: its module is
#   unpacked beside the sources.
#   TESTS="tests/test_cuda.py" K="causal"   which tests the test and grid steps run (default: every
#                                           GPU test, `-m gpu tests/`)
#   JAX_FLASH_KERNELS=sm80 JAX_FLASH_SMEM_LIMIT=101376   the grid as an sm_86/89 GPU runs it (the
#                                           checks then run that family alone: tests/test_cuda.py's
#                                           families_for); JAX_FLASH_KERNELS=sm75 as a T4 runs it
#   TIME_DEFAULT_BUILD=1                    the build step times the default build (no targets named),
#                                           then adds the test families to it
#   END_BY=$(( $(date +%s) + 540 ))         the test step ends by then, whatever the build took
#   TEST_TIMEOUT=300                        seconds before pytest is interrupted (SIGINT, so that it
#                                           still prints what passed and failed so far)
#   XDIST=4                                 run the tests in that many processes sharing the GPU
#                                           (pytest-xdist, carried as a wheel in .whl/ with execnet;
#                                           most of a GPU test's time is XLA compiling), then the
#                                           `timing` tests alone; TEST_TIMEOUT covers both
#   GRID="99k 163k sm75"                    the grid step (not part of all): the GPU tests but the timing
#                                           ones under each setting (best: none; 99k and 163k: the sm80
#                                           family under that shared-memory cap; sm75: Turing forced), in
#                                           XDIST processes (14 by default), then the `large` ones one at
#                                           a time (several at once exhaust the GPU's memory); a log a
#                                           setting, -v so that it names what passed when the call's time
#                                           runs out. TESTS and K narrow it; XLA's compiled programs are
#                                           cached in build/jax_cache (the references compile once)
#   JAX_FLASH_LINEINFO=1                    the build keeps source lines for the profile step's source view
#   BENCH="--quick"                         arguments of python -m jax_flash.bench
#   PROFILE="--head-dim 128" NCU_KERNEL=bwd_kernel   the profile step: ncu on one kernel of one
#                                           shape (not part of all); NCU_NAME_BASE=demangled matches
#                                           the regex against template arguments too (the peer's
#                                           kernels are all cutlass::device_kernel<...>)
#   the sanitize step: compute-sanitizer memcheck and racecheck on every kernel of a forward and
#   backward, causal and not, tails included (not part of all); SANITIZE_KERNEL=name limits them
#   to kernels whose name contains it; MASKS=1 runs them with lengths and segment ids (the masked
#   kernels), LENGTHS=1 with lengths alone (the masked kernels without segments: d = 64's
#   192-row tiles), SOFTCAP=c with that soft cap (the softcap kernels), BIAS=1 with a
#   differentiated bias (the bias kernels; with MASKS=1 also a boolean mask); SANITIZE_TOOLS="memcheck"
#   runs only that tool; SANITIZE_RUNS="--decode 2 3000 --kv-dtype fp8;--head-dim 64 --sinks ..."
#   replaces the runs (`;` between the argument lists of scripts/profile_once.py; by default d =
#   SANITIZE_HEAD_DIM (128), 1000 rows, causal and not)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step=${1:-all}
PY=${PYTHON:-python3}
# The checkout's package for scripts/ and examples/ too (a module from the carried wheel is unpacked in it).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv > "$OUT/gpu.txt" 2>&1
# FlashAttention-3's JAX binding and tokamax, carried as wheels in .whl/, become benchmark columns.
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && \
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  # tokamax (carried with its pure-Python requirements) imports xprof's CLI, a 32 MB wheel, for
  # its own benchmarking helpers alone: a stub stands in for it.
  if [[ -d /tmp/site/tokamax ]] && ! $PY -c "import xprof" 2> /dev/null; then
    mkdir -p /tmp/site/xprof/cli && touch /tmp/site/xprof/__init__.py /tmp/site/xprof/cli/__init__.py
    echo "get_kernel_stats_tool = None" > /tmp/site/xprof/cli/tools.py
  fi
fi

if [[ $step == build || $step == all ]] && compgen -G ".whl-h100/jax_flash-*.whl" > /dev/null; then
  # Built elsewhere (scripts/build_h100_wheel.sh): its compiled module goes beside the sources.
  $PY -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
[z.extract(n, '.') for n in z.namelist() if n.startswith('jax_flash/_cuda')]" .whl-h100/jax_flash-*.whl
  cp .whl-h100/ptxas.txt "$OUT/ptxas.txt" 2> /dev/null || true
  echo "build: the carried wheel's module, $(ls jax_flash/_cuda*)"
elif [[ $step == build || $step == all ]]; then
  build() {  # build LOG [VAR=value...]: pip's editable build, timed
    local log=$1 start=$(date +%s); shift
    env JAX_FLASH_CUDA=ON JAX_FLASH_PTXAS_VERBOSE=1 "$@" \
      $PY -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/$log" 2>&1 \
      || { tail -50 "$OUT/$log"; echo "BUILD FAILED"; exit 1; }
    echo "build ($*): $(( $(date +%s) - start )) s"
  }
  if [[ -n ${TIME_DEFAULT_BUILD:-} ]]; then
    # The default build (this GPU's targets and 80-virtual) timed, then the test families added to
    # it, which recompiles only their files.
    build build_default.log
    build build.log SKBUILD_CMAKE_DEFINE=JAX_FLASH_TEST_FAMILIES=ON  # -D: the cache keeps the first value
  else
    # Only sm_90a here: the sm80 kernels compiled for it are the code the H100 runs anyway; the
    # test families so that the grid can force the mma.sync and Turing families.
    build build.log JAX_FLASH_CUDA_ARCHS=${JAX_FLASH_CUDA_ARCHS:-90a} JAX_FLASH_TEST_FAMILIES=ON
  fi
  grep -E "Compiling entry|registers|spill|C75[0-9][0-9]" "$OUT/build.log" | sed 's/^ *//' > "$OUT/ptxas.txt"
  echo "kernels with spills:"
  grep -B1 -E "[1-9][0-9]* bytes spill stores" "$OUT/ptxas.txt" | grep -o "entry function '[^']*'" | sort -u || true
  echo "kernels whose wgmma ptxas serialized (C7510-C7519 infos):"
  grep -E "C751[0-9]\) Potential Performance Loss" "$OUT/ptxas.txt" | grep -o "function '[^']*'" | sort -u || true
fi

# Without the extension the tests skip and the benchmark times the xla path: say so and stop (a
# machine that went cold between calls has lost the build).
if [[ $step != build ]] && ! $PY -c "import jax_flash._cuda" 2> /dev/null; then
  echo "NO CUDA EXTENSION: run the build step first"
  exit 1
fi

# Seconds a test run may take: TEST_TIMEOUT, or what is left before END_BY.
time_left() {  # at least 1 (timeout refuses 0 and less)
  if [[ -n ${END_BY:-} ]]; then local left=$(( END_BY - $(date +%s) )); echo $(( left > 0 ? left : 1 ))
  else echo ${TEST_TIMEOUT:-3000}; fi
}

if [[ $step == test || $step == all ]]; then
  if [[ -n ${XDIST:-} ]]; then
    # Workers allocate GPU memory as they need it, not 75% of it each.
    (export XLA_PYTHON_CLIENT_PREALLOCATE=false
     timeout -s INT -k 20 $(time_left) bash -c '"$0" -m pytest -q -x -n "$XDIST" -m "gpu and not timing" "$@" && \
       "$0" -m pytest -q -x -m "gpu and timing" "$@"' $PY ${TESTS:-tests/} ${K:+-k "$K"}) \
      2>&1 | tee "$OUT/tests.log" | tail -30
  else
    timeout -s INT -k 20 $(time_left) $PY -m pytest -q -x -m gpu ${TESTS:-tests/} ${K:+-k "$K"} \
      2>&1 | tee "$OUT/tests.log" | tail -30
  fi
fi

if [[ $step == grid ]]; then
  export XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_COMPILATION_CACHE_DIR=$PWD/build/jax_cache \
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
  tests=${TESTS:-tests/}
  for setting in ${GRID:-best 99k 163k sm75}; do
    case $setting in
      best) env=() ;;
      99k) env=(JAX_FLASH_KERNELS=sm80 JAX_FLASH_SMEM_LIMIT=101376) ;;
      163k) env=(JAX_FLASH_KERNELS=sm80 JAX_FLASH_SMEM_LIMIT=166912) ;;
      sm75) env=(JAX_FLASH_KERNELS=sm75) ;;
      *) echo "unknown grid setting $setting"; exit 1 ;;
    esac
    env "${env[@]}" timeout -s INT -k 20 $(time_left) $PY -m pytest -v -n ${XDIST:-14} \
      -m "gpu and not timing and not large" $tests ${K:+-k "$K"} > "$OUT/grid_$setting.log" 2>&1
    env "${env[@]}" timeout -s INT -k 20 $(time_left) $PY -m pytest -v -m "gpu and large" $tests \
      ${K:+-k "$K"} >> "$OUT/grid_$setting.log" 2>&1
    echo "== $setting: $(grep -E "^=+ .*(passed|failed|error).* in " "$OUT/grid_$setting.log" | tr '\n' ' ')"
    grep -E "^FAILED|^ERROR" "$OUT/grid_$setting.log" | head -20
  done
fi

if [[ $step == bench || $step == all ]]; then
  $PY -m jax_flash.bench ${BENCH:-} --plot "$OUT/bench.png" --json "$OUT/bench.json" \
    2> /tmp/bench_progress.log | tee "$OUT/bench.log"
fi

if [[ $step == sanitize ]]; then
  # Without preallocation: under the sanitizer XLA's allocator otherwise probes ever smaller
  # arenas, and each failed cuMemCreate counts as an error of the run.
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  shape="--head-dim ${SANITIZE_HEAD_DIM:-128} --seqlen 1000 --tokens 2000"
  IFS=';' read -ra runs <<< "${SANITIZE_RUNS:-$shape;$shape --causal}"
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    for run in "${runs[@]}"; do
      echo "== $tool $run" | tee -a "$OUT/sanitize.log"
      start=$(date +%s)
      compute-sanitizer --tool $tool ${SANITIZE_KERNEL:+--kernel-name "kns=$SANITIZE_KERNEL"} --error-exitcode 1 \
        $PY scripts/profile_once.py $run ${MASKS:+--masks} ${LENGTHS:+--lengths} ${SOFTCAP:+--softcap $SOFTCAP} \
        ${BIAS:+--bias} >> "$OUT/sanitize.log" 2>&1 && echo "clean ($(( $(date +%s) - start )) s)" | tee -a "$OUT/sanitize.log" \
        || echo "ERRORS (see sanitize.log)"
    done
  done
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitize.log"
fi

if [[ $step == profile ]]; then
  ncu --clock-control none --kernel-name-base ${NCU_NAME_BASE:-function} -k "regex:${NCU_KERNEL:-bwd_kernel}" \
    -c 1 --set full \
    -o /tmp/profile -f $PY scripts/profile_once.py ${PROFILE:-} > /tmp/profile.log 2>&1 \
    || tail -20 /tmp/profile.log
  # At most 8 files come back from the device tool: the details page and the per-instruction
  # SASS table (with stall samples) are what a tuning step reads.
  ncu -i /tmp/profile.ncu-rep --page details > "$OUT/profile.txt" 2>&1
  ncu -i /tmp/profile.ncu-rep --page source --csv --print-source sass > "$OUT/profile_sass.csv" 2>&1
  grep -E "Duration|Throughput|Warp Cycles|Registers|Occupancy|Eligible" "$OUT/profile.txt" | head -30
fi
