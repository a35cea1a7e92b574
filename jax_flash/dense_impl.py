"""The `xla` path's dense formulation, for calls whose T x S scores fit a memory budget.

Where the scores fit, forming them whole is what XLA does fastest (one product, one softmax, one
product, and JAX's own gradient), as `jax.nn.dot_product_attention(implementation="xla")` does;
the blockwise loops of xla_impl.py only pay where memory would not allow that. The semantics are
the blockwise path's (lengths and segments through xla_impl's `band_visible` with one block
spanning the whole sequence): masks, segments, soft cap, bias, the bottom-right diagonal, empty
rows 0 with log-sum-exp -inf and zero gradients.

The budget counts one float32 [B, N, T, S] score matrix (JAX's gradient keeps about three such
arrays alive): 1/16 of the device's memory on a GPU (about 3.7 GB on an H100, whose JAX client
takes 75% of its 80 GB: the dense path ran 3-4x faster than the blockwise one at 2 GB of scores,
d = 320-1024), 8 MiB elsewhere: on a CPU the blockwise path was already faster from 16 MiB of
scores (docs/perf/log.md, "The xla path's dense formulation").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_flash import xla_impl
from jax_flash._validation import Call

CPU_BUDGET_BYTES = 8 * 2**20
GPU_MEMORY_FRACTION = 1 / 16


def budget_bytes() -> int:
    """The largest float32 score matrix the dense formulation may form, on the default backend."""
    if jax.default_backend() != "gpu":
        return CPU_BUDGET_BYTES
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("bytes_limit", 16 * 2**30) * GPU_MEMORY_FRACTION)


def score_bytes(call: Call) -> int:
    b, t, n, _ = call.query.shape
    return 4 * b * n * t * call.key.shape[1]


def fits(call: Call) -> bool:
    return score_bytes(call) <= budget_bytes()


# A banded call's backward skips the key blocks outside its band, so its blocks stay square.
BANDED_BACKWARD_BLOCK = 2048


def backward_blocks(call: Call) -> tuple[int, int]:
    """(block_q, block_k) for the blockwise backward on a GPU: as large as the memory budget lets
    one block's float32 scores be, since XLA runs large products near the dense formulation's
    speed (H100, d = 512, 8k, bf16: 512 x 512 blocks 133 TFLOP/s, 4096 queries x every key 384,
    jax.nn's dense backward 413; causal, 2048 x 2048: 191 against 92). Every key in one block
    unless the call is banded (causal, windows); the default blocks where the budget allows
    fewer rows than theirs."""
    b, t, n, _ = call.query.shape
    s = call.key.shape[1]
    banded = is_banded(call)
    block_k = min(s, BANDED_BACKWARD_BLOCK) if banded else s
    fitting_rows = budget_bytes() // (4 * b * n * max(block_k, 1))
    if fitting_rows < min(t, xla_impl.DEFAULT_BLOCK_Q):
        return xla_impl.DEFAULT_BLOCK_Q, xla_impl.DEFAULT_BLOCK_K
    rows = min(fitting_rows, BANDED_BACKWARD_BLOCK if banded else t)
    blocks = -(-t // rows)  # equal blocks of at most `rows`: T is padded by under 8 a block
    return xla_impl.round_up(-(-t // blocks), 8), max(block_k, 8)


def is_banded(call: Call) -> bool:
    """Whether a causal mask or window bounds the keys each query sees."""
    return call.config.window_left is not None or call.config.window_right is not None


def per_batch_row(call: Call) -> bool:
    """Whether visibility differs between batch rows (lengths, segment ids)."""
    return any(x is not None for x in (call.query_seq_lengths, call.key_value_seq_lengths, call.q_segment_ids))


def _band(call: Call) -> jax.Array | None:
    """Boolean [B or 1, 1, T, S] of what the lengths, causal mask, window and segments let
    through (xla_impl's rule); None where none of them is given."""
    if per_batch_row(call):
        return xla_impl.whole_band_visible(call)[:, None]
    if not is_banded(call):
        return None
    return xla_impl.whole_band_visible(call)[:1, None]  # the same for every batch row


def _every_row_sees_a_key(call: Call) -> bool:
    """Known before running: no mask, bias, lengths or segments, and S >= T, so that each query's
    diagonal key (which every band keeps) exists."""
    no_masks = call.mask is None and call.bias is None and not per_batch_row(call)
    return no_masks and call.key.shape[1] >= call.query.shape[1]


def _grouped(x: jax.Array | None, kv_heads: int, group: int):
    """A [B or 1, N or 1, T or 1, S or 1] bias or mask, and its vmap axis over the query heads of a
    kv head: split as [B, K, G, T, S] (axis 2) where it has every head, as it is (None) where not."""
    if x is None or x.shape[1] == 1:
        return x, None
    return x.reshape(x.shape[0], kv_heads, group, *x.shape[2:]), 2


def _product_algorithm(dtype):
    """On a GPU the 16-bit products name their algorithm (16-bit operands, float32 sums), as
    jax.nn does: the gradient's products then take 16-bit operands too, not the float32 cotangent
    (on an H100 the backward ran at half speed without it). XLA's CPU backend refuses F16_F16_F32."""
    if jax.default_backend() != "gpu":
        return None
    presets = {jnp.dtype(jnp.bfloat16): jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
               jnp.dtype(jnp.float16): jax.lax.DotAlgorithmPreset.F16_F16_F32}  # fmt: skip
    return presets.get(jnp.dtype(dtype))


def _one_query_head_per_kv_head(q, k, v, bias, mask, band, *, scale: float, softcap: float | None,
                                rows_see_keys: bool):
    """(out [B, T, K, H], lse [B, K, T]) for one query head of each kv head; `rows_see_keys`:
    known to leave no row without a key (then no guard against empty rows is computed)."""
    acc, out_dtype = jnp.promote_types(q.dtype, jnp.float32), v.dtype
    if min(q.shape[1], k.shape[1], q.shape[-1], v.shape[-1]) == 1:
        # Products with a side of 1 (one query, one key, head dim 1) are matrix-vector ones at most,
        # which XLA's GPU backend rewrites as elementwise: in 16 bits those rounded the logits to
        # 16 bits (lse off by 8.6e-3 at one query and one key, bfloat16) and refused F16_F16_F32
        # ("Unsupported dot precision algorithm"). In float32 they cost nothing more.
        q, k, v = (x.astype(acc) for x in (q, k, v))
    precision = _product_algorithm(q.dtype)
    logits = jnp.einsum("btkh,bskh->bkts", q, k, precision=precision, preferred_element_type=acc) * scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    if bias is not None:
        logits = logits + bias.astype(acc)
    visible = band if mask is None else mask if band is None else mask & band
    if visible is not None:
        logits = jnp.where(visible, logits, -jnp.inf)
    if rows_see_keys:
        probs, lse = jax.nn.softmax(logits, axis=-1), jax.nn.logsumexp(logits, axis=-1)
    else:
        # Hidden logits (and a bias's -inf) at the float's minimum, not -inf: a row with none
        # visible then has a finite softmax (no NaN in the gradient), which `seen` sets to 0.
        seen = (logits > -jnp.inf).any(-1, keepdims=True)
        finite = jnp.maximum(logits, jnp.finfo(acc).min)
        probs = jax.nn.softmax(finite, axis=-1) * seen
        lse = jnp.where(seen, jax.nn.logsumexp(finite, axis=-1, keepdims=True), -jnp.inf)[..., 0]
    return jnp.einsum("bkts,bskh->btkh", probs.astype(v.dtype), v, precision=precision).astype(out_dtype), lse


def attention(call: Call) -> tuple[jax.Array, jax.Array]:
    """(output [B, T, N, H], lse [B, T, N]) of a validated call, differentiable by JAX.

    As jax.nn's xla path does, the query heads of each kv head are a vmapped axis over a
    computation in [B, K, T, S]: on a CPU its gradient ran 1.2-1.5x faster than the same
    products written on [B, N, T, S] or [B, K, G, T, S] (docs/perf/log.md)."""
    q, k, v = xla_impl.within_lengths(call, *xla_impl.sequence_lengths(call))
    cfg = call.config
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    group = n // kv_heads
    bias, bias_axis = _grouped(call.bias, kv_heads, group)
    mask, mask_axis = _grouped(call.mask, kv_heads, group)
    core = functools.partial(_one_query_head_per_kv_head, scale=cfg.scale, softcap=cfg.softcap,
                             rows_see_keys=_every_row_sees_a_key(call))  # fmt: skip
    per_group = jax.vmap(core, in_axes=(3, None, None, bias_axis, mask_axis, None), out_axes=(3, 2))
    out, lse = per_group(q.reshape(b, t, kv_heads, group, h), k, v, bias, mask, _band(call))
    return out.reshape(b, t, n, v.shape[3]), lse.reshape(b, n, t).transpose(0, 2, 1)
