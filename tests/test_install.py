"""What an install says about itself: `python -m jax_flash.info`, the warning where a GPU has no
kernels of this install, and auto mode's order by GPU generation (cuDNN first on 10.x)."""

import subprocess
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import _ffi, cuda_impl, cudnn_fallback
from tests import fake_kernels

Q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
K = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)


def test_info_runs_as_a_module_and_names_the_install():
    result = subprocess.run([sys.executable, "-m", "jax_flash.info"], capture_output=True, text=True, check=True)
    assert result.stdout.startswith(f"jax_flash {jax_flash.__version__}")
    assert "auto mode" in result.stdout
    assert ("CUDA extension: not built" in result.stdout) == (_ffi.extension() is None)


def _gpu_without_kernels(monkeypatch, capability=(9, 0)):
    cuda_impl.warn_if_kernels_missing.cache_clear()
    monkeypatch.setattr(_ffi, "cuda_device_available", lambda: True)
    monkeypatch.setattr(_ffi, "device_capability", lambda: capability)
    monkeypatch.setattr(_ffi, "extension", lambda: None)
    monkeypatch.setattr(cudnn_fallback, "attention", lambda call: None)  # no cuDNN on this CPU


def test_a_gpu_without_this_installs_kernels_warns_once(monkeypatch):
    _gpu_without_kernels(monkeypatch)
    with pytest.warns(RuntimeWarning, match="without its CUDA extension.*pip install"):
        assert jax_flash.chosen_implementation(Q, K, K).startswith("xla")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax_flash.chosen_implementation(Q, K, K)  # once a process
    cuda_impl.warn_if_kernels_missing.cache_clear()


def test_a_gpu_older_than_the_kernels_does_not_warn(monkeypatch):
    _gpu_without_kernels(monkeypatch, capability=(7, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax_flash.chosen_implementation(Q, K, K)
    cuda_impl.warn_if_kernels_missing.cache_clear()


@pytest.mark.parametrize("capability, built, family", [
    ((9, 0), "75,80,90a,80-virtual", "Hopper"), ((9, 0), "80,80-virtual", "mma.sync"),
    ((8, 6), "75,80,90a,80-virtual", "mma.sync"), ((7, 5), "75,80,90a,80-virtual", "Turing"),
    ((12, 0), "75,80,90a,80-virtual", "mma.sync (sm_80 and later) JIT-compiled from PTX"),
    ((10, 0), "75,80,90a,80-virtual", "auto mode tries cuDNN first"), ((8, 6), "90a", "none: no machine code"),
    ((7, 0), "75,80,90a,80-virtual", "none: the kernels need"),
])  # fmt: skip
def test_the_family_each_gpu_runs(monkeypatch, capability, built, family):
    fake_kernels.install(monkeypatch)
    monkeypatch.setattr(_ffi, "extension", lambda: types.SimpleNamespace(built_archs=built))
    assert family in cuda_impl.family_name(capability)


@pytest.mark.parametrize("capability, first", [((10, 0), "cudnn"), ((10, 3), "cudnn"), ((12, 0), "cuda"),
                                               ((9, 0), "cuda"), ((8, 0), "cuda")])  # fmt: skip
def test_auto_mode_tries_cudnn_first_on_data_centre_blackwell(monkeypatch, capability, first):
    fake_kernels.install(monkeypatch)
    monkeypatch.setattr(_ffi, "device_capability", lambda: capability)
    monkeypatch.setattr(cudnn_fallback, "attention", lambda call: jnp.zeros(call.query.shape, call.query.dtype))
    assert jax_flash.chosen_implementation(Q, K, K, is_causal=True) == first
    # What cuDNN does not compute alike stays with the kernels there too.
    assert jax_flash.chosen_implementation(Q, K, K, softcap=30.0) == "cuda"
    assert jax_flash.chosen_implementation(Q, K, K, implementation="cuda") == "cuda"


def test_the_warning_points_at_the_users_call(monkeypatch):
    _gpu_without_kernels(monkeypatch)
    q = jnp.ones((1, 16, 2, 32), jnp.bfloat16)
    with pytest.warns(RuntimeWarning) as caught:
        jax.jit(lambda q: jax_flash.attention(q, q, q))(q)
    assert caught[0].filename == __file__
    cuda_impl.warn_if_kernels_missing.cache_clear()
