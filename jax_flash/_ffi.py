"""Loading the compiled CUDA module and registering its XLA FFI handlers (once, lazily).

The module `jax_flash._cuda` exists only when the package was built with a CUDA compiler. Its
`registrations()` returns `{target name: PyCapsule}`; each is registered for the CUDA platform the
first time a kernel is needed, so importing jax_flash never touches the GPU runtime.
"""

from __future__ import annotations

import functools
import importlib


@functools.cache
def extension():
    """The compiled module, or None when the package was installed without CUDA."""
    try:
        return importlib.import_module("jax_flash._cuda")
    except ImportError:
        return None


@functools.cache
def cuda_device_available() -> bool:
    import jax

    try:
        return any(d.platform == "gpu" for d in jax.devices()) and jax.default_backend() == "gpu"
    except RuntimeError:
        return False


@functools.cache
def register_targets() -> tuple[str, ...]:
    """Register every handler of the extension with XLA; returns the target names."""
    import jax

    module = extension()
    if module is None:
        return ()
    names = []
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
        names.append(name)
    return tuple(names)
