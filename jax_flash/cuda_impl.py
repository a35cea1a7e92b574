"""The `implementation="cuda"` path: our CUDA kernels behind XLA FFI custom calls."""

from __future__ import annotations

from jax_flash import _ffi
from jax_flash._validation import Call


def unsupported_reason(call: Call) -> str | None:
    """Why the CUDA kernels cannot run `call`, or None when they can."""
    if _ffi.extension() is None:
        return "jax_flash was installed without its CUDA extension (no nvcc at build time)"
    if not _ffi.cuda_device_available():
        return "no CUDA GPU is the default JAX backend"
    return "the CUDA kernels are not implemented yet"


def attention(call: Call):
    raise NotImplementedError(unsupported_reason(call))
