"""jax_flash: FlashAttention for JAX, with CUDA kernels and a pure-JAX blockwise path."""

from jax_flash._fp8 import quantize_kv
from jax_flash.attention import attention, chosen_implementation
from jax_flash.paged import paged_attention
from jax_flash.ragged import ragged_paged_attention
from jax_flash.ring import ring_attention, unzigzag, zigzag
from jax_flash.varlen import varlen_attention

__all__ = ["attention", "chosen_implementation", "paged_attention", "quantize_kv", "ragged_paged_attention", "ring_attention", "unzigzag", "varlen_attention", "zigzag"]
__version__ = "0.1.0"
