"""Shared test setup: float64 enabled (the reference runs in it), and the `gpu` marker's skip."""

import jax
import pytest

jax.config.update("jax_enable_x64", True)


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
