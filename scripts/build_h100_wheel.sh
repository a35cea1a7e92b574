#!/usr/bin/env bash
# Build, on a machine without a GPU, the cp312 wheel that scripts/gpu_check.sh installs on the H100
# machine instead of compiling there (its build step then only installs). Only sm_90a: the sm80
# kernels compiled for it are the code an H100 runs when they are forced. Incremental: the objects
# stay in build/ between runs. Needs a Python 3.12 environment with scikit-build-core, nanobind,
# ninja and jaxlib 0.6.2 (the FFI headers the extension must be built against), given as BUILD_PY.
#   BUILD_PY=/tmp/buildvenv/bin/python scripts/build_h100_wheel.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_PY=${BUILD_PY:?a Python 3.12 with scikit-build-core, nanobind, ninja and jaxlib==0.6.2}
rm -f .whl-h100/jax_flash-*.whl
JAX_FLASH_CUDA=ON JAX_FLASH_CUDA_ARCHS=90a JAX_FLASH_TEST_FAMILIES=ON JAX_FLASH_PTXAS_VERBOSE=1 \
  "$BUILD_PY" -m pip wheel --no-build-isolation --no-deps -v -w .whl-h100 . > .whl-h100/build.log 2>&1 \
  || { tail -40 .whl-h100/build.log; exit 1; }
grep -E "Compiling entry|registers|spill" .whl-h100/build.log | sed 's/^ *//' > .whl-h100/ptxas.txt
ls -la .whl-h100/*.whl
