"""A naive float64 attention with the semantics of DESIGN.md, written independently of jax_flash.

It forms the whole [B, N, T, S] logits matrix, so keep the sizes small. Differentiable (jax.grad),
including on fully masked rows.
"""

import jax
import jax.numpy as jnp
import numpy as np


def visibility(b, n, t, s, *, is_causal=False, local_window_size=None, query_seq_lengths=None,
               key_value_seq_lengths=None, q_segment_ids=None, kv_segment_ids=None, mask=None,
               diagonal_by_lengths=None):
    """Boolean [B, N, T, S]: which query sees which key. The diagonal: query i at key position
    i + S - T; with lengths and `diagonal_by_lengths` (default: T != S) at i + kv_len - q_len."""
    q_len = jnp.full((b,), t) if query_seq_lengths is None else jnp.asarray(query_seq_lengths)
    kv_len = jnp.full((b,), s) if key_value_seq_lengths is None else jnp.asarray(key_value_seq_lengths)
    i = jnp.arange(t)[None, :, None]
    j = jnp.arange(s)[None, None, :]
    by_lengths = t != s if diagonal_by_lengths is None else diagonal_by_lengths
    offset = (kv_len - q_len) if by_lengths else jnp.full((b,), s - t)
    diagonal = i + offset[:, None, None]
    vis = (i < q_len[:, None, None]) & (j < kv_len[:, None, None])
    if is_causal:
        vis &= j <= diagonal
    if local_window_size is not None:
        left, right = (local_window_size,) * 2 if isinstance(local_window_size, int) else local_window_size
        vis &= (j >= diagonal - left) & (j <= diagonal + right)
    if q_segment_ids is not None:
        vis &= jnp.asarray(q_segment_ids)[:, :, None] == jnp.asarray(kv_segment_ids)[:, None, :]
    vis = jnp.broadcast_to(vis[:, None], (b, n, t, s))
    if mask is not None:
        vis &= jnp.broadcast_to(mask, (b, n, t, s))
    return vis


def attention(q, k, v, bias=None, mask=None, *, scale=None, softcap=None, sinks=None, **mask_kwargs):
    """(output [B, T, N, H], lse [B, T, N]) in float64. `sinks` [N]: one more logit in each row's
    softmax, of a key with no value (the lse includes it)."""
    q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
    b, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    k = jnp.repeat(k, n // kv_heads, axis=2)
    v = jnp.repeat(v, n // kv_heads, axis=2)
    scale = 1.0 / np.sqrt(h) if scale is None else scale
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    if bias is not None:
        logits = logits + jnp.asarray(bias, jnp.float64)
    vis = visibility(b, n, t, s, mask=mask, **mask_kwargs)
    logits = jnp.where(vis, logits, -jnp.inf)
    if sinks is not None:
        sink = jnp.broadcast_to(jnp.asarray(sinks, jnp.float64)[None, :, None, None], (b, n, t, 1))
        logits = jnp.concatenate([logits, sink], axis=-1)
    m = jax.lax.stop_gradient(logits.max(-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(logits - m)
    total = e.sum(-1, keepdims=True)
    p = e / jnp.where(total == 0, 1.0, total)
    out = jnp.einsum("bnts,bsnd->btnd", p[..., :s], v)  # the value head dim d may differ from h
    lse = jnp.where(total[..., 0] == 0, -jnp.inf, jnp.log(jnp.where(total[..., 0] == 0, 1.0, total[..., 0])) + m[..., 0])
    return out, lse.transpose(0, 2, 1)


def rel_error(x, ref):
    """||x - ref|| / ||ref|| in float64 (-inf entries must match exactly and are left out)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    assert not np.isnan(x).any(), "NaN in result"
    finite = np.isfinite(ref)
    assert np.array_equal(np.isfinite(x), finite), "infinities differ from the reference"
    num = np.linalg.norm(x[finite] - ref[finite])
    den = np.linalg.norm(ref[finite])
    return num / den if den > 0 else num
