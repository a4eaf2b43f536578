#!/usr/bin/env bash
# The GPU checks, in one go, on a machine with an NVIDIA GPU and jax's CUDA plugin
# (how bench/results/gpu.* were made; see bench/gpu_bench.py):
#   1. the package's own build (`pip install .`: scikit-build-core + CMake + nanobind;
#      the CUDA handlers are plain C++ that load jax's libcudart at run time, no nvcc),
#   2. the CUDA tests (tests/native/test_cuda_gpu.py, test_cuda_handlers.py) on the GPU,
#   3. the quickstart's demo (python -m jaxmem demo) on the GPU,
#   4. bench/gpu_bench.py: one plan through both backends, peak and step time.
# Usage: OUT=DIR [PYTHON=python3] [MODELS=mlp,gpt] [DEADLINE=seconds] [PROFILE=gpt]
#        bench/gpu_check.sh [build|test|demo|bench|aot]...
# (aot: bench/gpu_aot.py --no-fit on the same machine, JAX_PLATFORMS=cpu: the
# `gpu:h100` target's deviceless compile with the GPU's own jax, next to the GPU.)
# With no stage named, runs all four. Logs and results go to $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jaxmem_gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # peaks are read from the compiled program
stages=${*:-build test demo bench}
rc=0
for stage in $stages; do
  echo "=== $stage ($(date +%T))"
  case $stage in
    build)
      { nvidia-smi -L; "$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"; } 2>&1 | tee "$OUT/env.txt"
      if ! "$PY" -m pip install --no-build-isolation --no-deps --no-index . >"$OUT/build.log" 2>&1; then
        tail -40 "$OUT/build.log"; exit 1
      fi
      grep -i "jaxmem: \|CUDA" "$OUT/build.log" | head -5
      (cd /tmp && "$PY" -c "import jaxmem, jaxmem.native as n; print(jaxmem.__file__); print('WITH_CUDA', n.WITH_CUDA, '|', n.CUDA_STATUS)") 2>&1 | tee -a "$OUT/env.txt"
      ;;
    test)
      timeout "${TEST_TIMEOUT:-200}" "$PY" -m pytest -q -p no:cacheprovider -o addopts="" \
        tests/native/test_cuda_gpu.py tests/native/test_cuda_handlers.py >"$OUT/pytest.log" 2>&1 || rc=1
      tail -25 "$OUT/pytest.log"
      ;;
    demo)
      (cd /tmp && timeout "${DEMO_TIMEOUT:-90}" "$PY" -m jaxmem demo) >"$OUT/demo.log" 2>&1 || rc=1
      tail -15 "$OUT/demo.log"
      ;;
    bench)
      timeout "${BENCH_TIMEOUT:-330}" "$PY" bench/gpu_bench.py --out "$OUT" \
        --models "${MODELS:-mlp,gpt,resnet18}" --deadline "${DEADLINE:-240}" \
        --steps "${STEPS:-10}" --profile "${PROFILE:-}" 2>"$OUT/bench.log" | tail -20 || rc=1
      grep -v "^\s" "$OUT/bench.log" | grep "\] \[" | tail -30
      ;;
    aot)
      JAX_PLATFORMS=cpu JAXMEM_MACHINE="on the GPU machine, deviceless" timeout "${AOT_TIMEOUT:-120}" \
        "$PY" bench/gpu_aot.py --no-fit --models "${MODELS:-mlp,gpt,resnet18}" --out "$OUT" \
        --device-results "$OUT/gpu.json" \
        2>"$OUT/aot.log" | tail -25 || rc=1
      ;;
    *) echo "unknown stage $stage (build, test, demo, bench, aot)"; exit 2 ;;
  esac
done
exit $rc
