"""Shared test setup: eight host devices (the sharding tests), float64 enabled (the reference
runs in it), compilation without LLVM's optimisations on a machine with no GPU, a compilation
cache for the run, and the `gpu` marker's skip."""

import atexit
import os
import shutil
import tempfile

# Set before JAX starts its CPU backend; it only adds CPU devices, the default device is unchanged.
flags = [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
# The CPU tests' programs are small and each runs a few times: compiling them takes most of the
# suite's time, and unoptimised they compile in about half of it. Not on a GPU machine, where
# the flag would slow the GPU code that the timing tests measure.
if not os.path.exists("/proc/driver/nvidia/version") and "xla_backend_optimization_level" not in flags[0]:
    flags.append("--xla_backend_optimization_level=0")
os.environ["XLA_FLAGS"] = " ".join(flags).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)

# Many tests compile the same programs (the reference, the same call in other transforms):
# XLA's persistent cache, in a directory of this run alone (so every run starts cold), compiles
# each once; it cut the CPU suite's time by about a fifth. Not where the user points it elsewhere.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _cache_dir = tempfile.mkdtemp(prefix="jax_flash_test_cache_")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _cuda_ready() -> bool:
    from jax_flash import _ffi

    return _ffi.extension() is not None and _ffi.cuda_device_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_ready():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and jax_flash built with its CUDA extension")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
