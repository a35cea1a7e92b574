"""The build backend: scikit-build-core's, plus PyPI's CUDA compiler where a GPU machine has none.

On Linux with an NVIDIA driver but no `nvcc` on the PATH, the wheel's build requirements gain the
CUDA compiler wheels (`nvidia-cuda-nvcc` and the headers, NVVM and runtime it needs; the ones
`pip install "jax[cuda13]"` installs), so that `pip install` gives kernels with no CUDA toolkit
installed; CMakeLists.txt finds that compiler in site-packages. JAX_FLASH_CUDA=ON asks for them
even without a driver (a build machine, CI); JAX_FLASH_CUDA=OFF never (a pure-Python install).
With --no-build-isolation nothing is added: the environment's own wheels (or toolkit) are used.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys

from scikit_build_core import build as _scikit_build
from scikit_build_core.build import *  # noqa: F401,F403  (the other hooks, as they are)

CUDA_COMPILER_WHEELS = ["nvidia-cuda-nvcc>=13.0,<14", "nvidia-cuda-crt>=13.0,<14", "nvidia-nvvm>=13.0,<14",
                        "nvidia-cuda-runtime>=13.0,<14", "nvidia-cuda-cccl>=13.0,<14"]  # fmt: skip


def _nvidia_driver() -> bool:
    return os.path.exists("/proc/driver/nvidia/version") or shutil.which("nvidia-smi") is not None


def wants_pypi_compiler() -> bool:
    """Whether this build takes its CUDA compiler from PyPI (the rule the module docstring states)."""
    setting = os.environ.get("JAX_FLASH_CUDA", "AUTO").upper()
    if setting == "OFF" or sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"):
        return False
    if shutil.which("nvcc") is not None or os.environ.get("CUDACXX"):
        return False
    return setting == "ON" or _nvidia_driver()


def get_requires_for_build_wheel(config_settings=None):
    extra = CUDA_COMPILER_WHEELS if wants_pypi_compiler() else []
    return _scikit_build.get_requires_for_build_wheel(config_settings) + extra


def get_requires_for_build_editable(config_settings=None):
    extra = CUDA_COMPILER_WHEELS if wants_pypi_compiler() else []
    return _scikit_build.get_requires_for_build_editable(config_settings) + extra
