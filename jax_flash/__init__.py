"""jax_flash: FlashAttention for JAX, with CUDA kernels and a pure-JAX blockwise path."""

from jax_flash.attention import attention

__all__ = ["attention"]
__version__ = "0.1.0"
