"""Auto mode's path on a CUDA GPU whose calls our kernels cannot run (a GPU generation without
our machine code, such as Blackwell today): `jax.nn.dot_product_attention` with cuDNN, where it
computes exactly what `jax_flash.attention` defines, else (`reason` says why) the `xla` path.

cuDNN takes the calls whose meaning `jax.nn` shares with us: float16 or bfloat16, equal head dims,
no soft cap or segment ids (`jax.nn` has neither), no bias (its gradient in cuDNN is limited to
some shapes), and no mask, sequence lengths or causal/window band that could differ: `jax.nn`
aligns the diagonal top-left and does not move it with lengths, and a fully masked row need not
give 0 there. So a band only where T == S, where the two alignments agree. The log-sum-exp
(`return_residual`) stays with the `xla` path too. What cuDNN itself refuses (its head dims, its
version on this GPU), `jax.nn` says when the call is traced; the call then takes the `xla` path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash import _ffi
from jax_flash._validation import Call

CUDNN_DTYPES = (jnp.float16, jnp.bfloat16)


def _jax_nn_band(call: Call) -> tuple[bool, tuple[int, int] | None]:
    """The call's band as jax.nn's `is_causal` and `local_window_size` (the same band where T == S):
    unbounded sides of a window as a side of the whole key length."""
    left, right = call.config.window_left, call.config.window_right
    if right == 0 and left is None:
        return True, None
    if left is None and right is None:
        return False, None
    s = call.key.shape[1]
    return False, (s if left is None else left, s if right is None else right)


def reason(call: Call, return_residual: bool) -> str | None:
    """Why auto mode cannot hand this call to cuDNN (the kernels having refused it), or None."""
    if not _ffi.cuda_device_available():
        return "the default JAX backend is not a CUDA GPU"
    if call.query.dtype not in CUDNN_DTYPES:
        return f"cuDNN takes float16 or bfloat16, got {call.query.dtype}"
    if call.value.shape[-1] != call.query.shape[-1]:
        return "jax.nn needs equal query and value head dims"
    if call.config.softcap is not None or call.q_segment_ids is not None:
        return "jax.nn has no soft cap or segment ids"
    if call.bias is not None or call.mask is not None:
        return "a bias or mask stays with the xla path (cuDNN's bias gradient, fully masked rows)"
    if call.query_seq_lengths is not None or call.key_value_seq_lengths is not None:
        return "sequence lengths move our diagonal and can empty rows; jax.nn's do neither"
    is_causal, window = _jax_nn_band(call)
    if (is_causal or window is not None) and call.query.shape[1] != call.key.shape[1]:
        return "a causal or window band with T != S: jax.nn aligns it top-left, we bottom-right"
    if return_residual:
        return "the log-sum-exp (return_residual) comes from the xla path"
    return None


def attention(call: Call) -> jax.Array | None:
    """The output of `jax.nn.dot_product_attention(..., implementation="cudnn")` for a call that
    `reason` allows, or None where `jax.nn` refuses it when traced (cuDNN's head dims, version or
    GPU)."""
    is_causal, window = _jax_nn_band(call)
    try:
        return jax.nn.dot_product_attention(call.query, call.key, call.value, scale=call.config.scale,
                                            is_causal=is_causal, local_window_size=window,
                                            implementation="cudnn")  # fmt: skip
    except (NotImplementedError, ValueError, RuntimeError):
        return None
