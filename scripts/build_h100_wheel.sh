#!/usr/bin/env bash
# Build, on a machine without a GPU, the cp312 wheel that scripts/gpu_check.sh installs on the GPU
# machine instead of compiling there (its build step then only installs). Only sm_90a: the sm80
# kernels compiled for it are the code an H100/H200 runs when they are forced.
#   BUILD_PY=/tmp/buildvenv/bin/python scripts/build_h100_wheel.sh
#     the machine's nvcc, incremental (the objects stay in build/ between runs); BUILD_PY is a
#     Python 3.12 with scikit-build-core, nanobind, ninja and jaxlib==0.6.2 (the FFI headers the
#     extension must be built against); with the test families, so the grid can force them
#   PYPI_COMPILER=1 BUILD_PY=python3.12 scripts/build_h100_wheel.sh
#     as a pip user without a CUDA toolkit builds it: nvcc off the PATH, build isolation (PyPI's
#     CUDA compiler and jaxlib 0.6.2's headers come from the build requirements), from scratch;
#     the default families only (what such a user's install runs)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_PY=${BUILD_PY:?a Python 3.12 (see above)}
mkdir -p .whl-h100 && rm -f .whl-h100/jax_flash-*.whl
start=$(date +%s)
if [[ -n ${PYPI_COMPILER:-} ]]; then
  source scripts/path_without_nvcc.sh
  env -u CUDACXX PATH="$(path_without_nvcc)" JAX_FLASH_CUDA=ON JAX_FLASH_CUDA_ARCHS=90a \
    JAX_FLASH_PTXAS_VERBOSE=1 "$BUILD_PY" -m pip wheel --no-deps -v -w .whl-h100 . \
    > .whl-h100/build.log 2>&1 || { tail -40 .whl-h100/build.log; exit 1; }
  grep -m1 "jax_flash: PyPI's CUDA compiler at" .whl-h100/build.log \
    || { echo "the wheel was not built with PyPI's CUDA compiler"; exit 1; }
else
  JAX_FLASH_CUDA=ON JAX_FLASH_CUDA_ARCHS=90a JAX_FLASH_TEST_FAMILIES=ON JAX_FLASH_PTXAS_VERBOSE=1 \
    "$BUILD_PY" -m pip wheel --no-build-isolation --no-deps -v -w .whl-h100 . \
    > .whl-h100/build.log 2>&1 || { tail -40 .whl-h100/build.log; exit 1; }
fi
grep -E "Compiling entry|registers|spill" .whl-h100/build.log | sed 's/^ *//' > .whl-h100/ptxas.txt
echo "built in $(( $(date +%s) - start )) s"
ls -la .whl-h100/*.whl
