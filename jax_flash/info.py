"""`python -m jax_flash.info`: what this install holds and what it runs on the GPUs here.

The package and JAX versions, the CUDA extension (its file, size, targets and the XLA FFI API it
was built against), each GPU with the kernel family it runs, and the path auto mode picks for a
typical call on the default device.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import jaxlib

import jax_flash
from jax_flash import _ffi, cuda_impl


def lines() -> list[str]:
    out = [f"jax_flash {jax_flash.__version__} at {os.path.dirname(jax_flash.__file__)}",
           f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, default backend {jax.default_backend()}"]  # fmt: skip
    module = _ffi.extension()
    if module is None:
        out.append("CUDA extension: not built (no CUDA compiler at build time, or JAX_FLASH_CUDA=OFF); "
                   f"to build it, {cuda_impl.REINSTALL}")  # fmt: skip
    else:
        size = os.path.getsize(module.__file__) / 2**20
        api = getattr(module, "ffi_api_version", "not recorded (an older build)")
        out.append(f"CUDA extension: {module.__file__} ({size:.0f} MB), targets {', '.join(_ffi.built_archs())}, "
                   f"XLA FFI API {api}")  # fmt: skip
    gpus = [d for d in jax.devices() if d.platform == "gpu"] if jax.default_backend() == "gpu" else []
    for device in gpus:
        major, minor = (int(x) for x in str(getattr(device, "compute_capability", "0.0")).split(".")[:2])
        out.append(f"GPU {device.id}: {device.device_kind}, compute capability {major}.{minor}: "
                   f"{cuda_impl.family_name((major, minor))}")  # fmt: skip
    if not gpus:
        out.append("GPUs: none visible to JAX; every call takes the xla path")
    q = jax.ShapeDtypeStruct((1, 4096, 16, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 4096, 4, 128), jnp.bfloat16)
    path = jax_flash.chosen_implementation(q, k, k, is_causal=True)
    out.append(f"auto mode, bfloat16 causal [1, 4096, 16, 128] over 4 kv heads: {path}")
    return out


def main() -> None:
    print("\n".join(lines()))


if __name__ == "__main__":
    main()
