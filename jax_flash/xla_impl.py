"""The `implementation="xla"` path: FlashAttention-2 written in plain JAX.

Forward: for each block of `block_q` queries (a `lax.map`), loop over the key blocks that the
mask band can reach, keeping the running row max `m`, row sum `l` and output accumulator in
float32 (online softmax). Backward: recompute each probability block from the saved log-sum-exp,
accumulate dQ per query block and dK/dV (and dBias) across query blocks. Forward mode: the same
loops carrying the tangents of the row sums and the output. No buffer larger than
`block_q x block_k` per head is ever formed, so memory is O(seqlen) (`tests/test_memory.py`).

Shapes inside: queries are grouped as [B, T, K, G, H] (G = N // K query heads share one K/V head),
so GQA never repeats K/V; logits blocks are [B, K, G, block_q, block_k].
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_flash import _tangent as _tangent_map
from jax_flash._partition import vary_like, zeros_like
from jax_flash._validation import AttentionConfig, Call

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512


class _Plan(NamedTuple):
    """Static block geometry: sizes, counts and padded lengths."""

    block_q: int
    block_k: int
    num_q_blocks: int
    num_k_blocks: int
    static_offset: int | None  # S - T, when no sequence lengths make the diagonal per-batch


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _make_plan(t: int, s: int, offset_per_row: bool, block_q: int, block_k: int) -> _Plan:
    bq = min(block_q, round_up(t, 8))
    bk = min(block_k, round_up(s, 8))
    return _Plan(bq, bk, -(-t // bq), -(-s // bk), None if offset_per_row else s - t)


def within_lengths(call: Call, q_len, kv_len) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q, k, v) with query rows at or past q_len and keys and values at or past kv_len set to 0.
    Those are ignored, but a NaN or inf there would still reach the output and the gradients
    through a zero probability (0 * inf = NaN): a stale slot of a recycled cache, or a page that
    only a padding entry of the page table names. Free where no lengths are given."""
    q, k, v = call.query, call.key, call.value
    if call.query_seq_lengths is not None:
        rows = jnp.arange(q.shape[1], dtype=jnp.int32)[None, :, None, None] < q_len[:, None, None, None]
        q = jnp.where(rows, q, jnp.zeros((), q.dtype))
    if call.key_value_seq_lengths is not None:
        keys = jnp.arange(k.shape[1], dtype=jnp.int32)[None, :, None, None] < kv_len[:, None, None, None]
        k, v = jnp.where(keys, k, jnp.zeros((), k.dtype)), jnp.where(keys, v, jnp.zeros((), v.dtype))
    return q, k, v


def sequence_lengths(call: Call) -> tuple[jax.Array, jax.Array]:
    """int32 [B] query and key lengths, clamped into the sequences (T and S where not given)."""
    b, t, s = call.query.shape[0], call.query.shape[1], call.key.shape[1]
    full = lambda x: jnp.full((b,), x, jnp.int32)  # noqa: E731
    q_len = full(t) if call.query_seq_lengths is None else jnp.clip(call.query_seq_lengths, 0, t)
    kv_len = full(s) if call.key_value_seq_lengths is None else jnp.clip(call.key_value_seq_lengths, 0, s)
    return q_len, kv_len


class _Operands(NamedTuple):
    """Padded inputs of the blockwise loops (padding rows/keys are masked out)."""

    q: jax.Array  # [B, Tp, K, G, H]
    k: jax.Array  # [B, Sp, K, H]
    v: jax.Array  # [B, Sp, K, H]
    bias: jax.Array | None  # [Bb, Kb, Gb, Tb, Sb], axes of size 1 broadcast
    mask: jax.Array | None  # bool, like bias
    q_len: jax.Array  # int32 [B]
    kv_len: jax.Array  # int32 [B]
    offset: jax.Array  # int32 [B]: diagonal offset (AttentionConfig.diagonal_offsets)
    q_seg: jax.Array | None  # int32 [B, Tp]
    kv_seg: jax.Array | None  # int32 [B, Sp]


def _pad_axis(x, axis: int, size: int, value=0):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _grouped_bnts(x, n: int, kv_heads: int, tp: int, sp: int):
    """[Bx, Nx, Tx, Sx] -> [Bx, Kx, Gx, Tx, Sx], padding the axes that are not broadcast."""
    if x is None:
        return None
    bx, nx, tx, sx = x.shape
    x = x[:, :, None] if nx == 1 else x.reshape(bx, kv_heads, n // kv_heads, tx, sx)
    if tx > 1:
        x = _pad_axis(x, 3, tp)
    if sx > 1:
        x = _pad_axis(x, 4, sp)
    return x


def _present(ops: _Operands) -> list[jax.Array]:
    return [x for x in ops if x is not None]


def _tile(x, q_start, bq: int, k_start, bk: int):
    """The [.., bq, bk] tile of a broadcastable bias/mask (broadcast axes stay size 1)."""
    if x.shape[3] > 1:
        x = lax.dynamic_slice_in_dim(x, q_start, bq, axis=3)
    if x.shape[4] > 1:
        x = lax.dynamic_slice_in_dim(x, k_start, bk, axis=4)
    return x


def _operands(call: Call, plan: _Plan) -> _Operands:
    b, t, n, h = call.query.shape
    s, kv_heads = call.key.shape[1], call.key.shape[2]
    q_len, kv_len = sequence_lengths(call)
    q, k, v = within_lengths(call, q_len, kv_len)
    tp, sp = plan.num_q_blocks * plan.block_q, plan.num_k_blocks * plan.block_k
    q = _pad_axis(q, 1, tp).reshape(b, tp, kv_heads, n // kv_heads, h)
    k, v = _pad_axis(k, 1, sp), _pad_axis(v, 1, sp)
    q_seg = kv_seg = None
    if call.q_segment_ids is not None:
        q_seg = _pad_axis(call.q_segment_ids, 1, tp, -1)
        kv_seg = _pad_axis(call.kv_segment_ids, 1, sp, -2)
    return _Operands(
        q, k, v,
        _grouped_bnts(call.bias, n, kv_heads, tp, sp),
        _grouped_bnts(call.mask, n, kv_heads, tp, sp),
        q_len, kv_len, call.config.diagonal_offsets(t, s, q_len, kv_len), q_seg, kv_seg,
    )  # fmt: skip


def _key_block_range(cfg: AttentionConfig, plan: _Plan, iq):
    """Key blocks [lo, hi) that query block `iq` can see; all of them when the band is per-batch."""
    if plan.static_offset is None:
        return 0, plan.num_k_blocks
    first_q = iq * plan.block_q + plan.static_offset
    lo, hi = 0, plan.num_k_blocks
    if cfg.window_left is not None:
        lo = jnp.clip((first_q - cfg.window_left) // plan.block_k, 0, plan.num_k_blocks)
    if cfg.window_right is not None:
        last_key = first_q + plan.block_q - 1 + cfg.window_right
        hi = jnp.clip(last_key // plan.block_k + 1, 0, plan.num_k_blocks)
    return lo, hi


def band_visible(cfg: AttentionConfig, plan: _Plan, ops: _Operands, iq, jk):
    """Boolean [B, bq, bk]: which (query, key) pairs of this tile the lengths, the band (causal,
    window) and the segment ids let through (the same for every head)."""
    qi = iq * plan.block_q + jnp.arange(plan.block_q, dtype=jnp.int32)
    kj = jk * plan.block_k + jnp.arange(plan.block_k, dtype=jnp.int32)
    vis = (qi[None, :, None] < ops.q_len[:, None, None]) & (
        kj[None, None, :] < ops.kv_len[:, None, None]
    )
    rel = kj[None, None, :] - qi[None, :, None] - ops.offset[:, None, None]
    if cfg.window_left is not None:
        vis &= rel >= -cfg.window_left
    if cfg.window_right is not None:
        vis &= rel <= cfg.window_right
    if ops.q_seg is not None:
        q_seg = lax.dynamic_slice_in_dim(ops.q_seg, iq * plan.block_q, plan.block_q, axis=1)
        kv_seg = lax.dynamic_slice_in_dim(ops.kv_seg, jk * plan.block_k, plan.block_k, axis=1)
        vis &= q_seg[:, :, None] == kv_seg[:, None, :]
    return vis


def whole_band_visible(call: Call) -> jax.Array:
    """Boolean [B, T, S]: band_visible with one block spanning both sequences (nothing padded)."""
    t, s = call.query.shape[1], call.key.shape[1]
    plan = _Plan(t, s, 1, 1, None)
    q_len, kv_len = sequence_lengths(call)
    ops = _Operands(None, None, None, None, None, q_len, kv_len, call.config.diagonal_offsets(t, s, q_len, kv_len),
                    call.q_segment_ids, call.kv_segment_ids)  # fmt: skip
    return band_visible(call.config, plan, ops, 0, 0)


def _visible(cfg: AttentionConfig, plan: _Plan, ops: _Operands, iq, jk):
    """Boolean [B, Kx, Gx, bq, bk]: which (query, key) pairs of this tile take part."""
    vis = band_visible(cfg, plan, ops, iq, jk)[:, None, None]
    if ops.mask is not None:
        vis &= _tile(ops.mask, iq * plan.block_q, plan.block_q, jk * plan.block_k, plan.block_k)
    return vis


def _logits(cfg, plan, ops, q_block, iq, jk):
    """Masked logits of one tile (-inf where not visible), and tanh(raw/softcap) for the backward."""
    acc = _acc_dtype(ops.q.dtype)
    k_block = lax.dynamic_slice_in_dim(ops.k, jk * plan.block_k, plan.block_k, axis=1)
    s = jnp.einsum("bqkgh,bskh->bkgqs", q_block, k_block, preferred_element_type=acc) * cfg.scale
    tanh_s = None
    if cfg.softcap is not None:
        tanh_s = jnp.tanh(s / cfg.softcap)
        s = cfg.softcap * tanh_s
    if ops.bias is not None:
        tile = _tile(ops.bias, iq * plan.block_q, plan.block_q, jk * plan.block_k, plan.block_k)
        s = s + tile.astype(acc)
    return jnp.where(_visible(cfg, plan, ops, iq, jk), s, -jnp.inf), tanh_s


def _acc_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _forward_q_block(cfg, plan, ops, iq):
    b, _, kv_heads, g, h = ops.q.shape
    acc = _acc_dtype(ops.q.dtype)
    q_block = lax.dynamic_slice_in_dim(ops.q, iq * plan.block_q, plan.block_q, axis=1)

    def step(jk, carry):
        m, l, o = carry
        s, _ = _logits(cfg, plan, ops, q_block, iq, jk)
        m_new = jnp.maximum(m, s.max(-1))
        # A row with nothing visible so far keeps m = -inf; shift it by 0 so exp gives 0, not NaN.
        m_shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_shift[..., None])
        rescale = jnp.exp(m - m_shift)
        v_block = lax.dynamic_slice_in_dim(ops.v, jk * plan.block_k, plan.block_k, axis=1)
        pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(ops.v.dtype), v_block,
                        preferred_element_type=acc)  # fmt: skip
        return m_new, rescale * l + p.sum(-1), rescale[..., None] * o + pv

    # zeros_like, not zeros: the carries then take q's sharding. Inside shard_map they vary over the
    # mesh axes of every operand, as the loop's outputs do.
    hv = ops.v.shape[3]
    q_zeros = zeros_like(q_block, acc)
    if hv != h:  # the value head dim: zeros of q_block's split, with Hv columns (a sum: H may be 0)
        q_zeros = jnp.broadcast_to(q_zeros.sum(-1, keepdims=True), q_zeros.shape[:4] + (hv,))
    o0 = q_zeros.transpose(0, 2, 3, 1, 4)  # [B, K, G, bq, Hv]
    l0 = o0.sum(-1)  # zeros of the row statistics' shape (a sum, not o0[..., 0]: H may be 0)
    init = vary_like((l0 - jnp.inf, l0, o0), *_present(ops))
    lo, hi = _key_block_range(cfg, plan, iq)
    m, l, o = lax.fori_loop(lo, hi, step, init)
    empty = l == 0  # fully masked rows: output 0, log-sum-exp -inf
    l_safe = jnp.where(empty, 1.0, l)
    out = o / l_safe[..., None]
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, plan.block_q, kv_heads * g, hv)
    lse = lse.transpose(0, 3, 1, 2).reshape(b, plan.block_q, kv_heads * g)
    return out.astype(ops.q.dtype), lse


def _unblock(x, length: int):
    """[num_blocks, B, block, ...] -> [B, length, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    x = x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])
    return x[:, :length]


def _forward(cfg, plan, ops, t):
    out, lse = lax.map(functools.partial(_forward_q_block, cfg, plan, ops),
                       jnp.arange(plan.num_q_blocks))  # fmt: skip
    return _unblock(out, t), _unblock(lse, t)


def _reduce_to(x, shape):
    """Sum a [B, K, G, bq, bk] tile down to a broadcastable shape (axes of size 1)."""
    axes = tuple(i for i, size in enumerate(shape) if size == 1 and x.shape[i] != 1)
    return x.sum(axes, keepdims=True) if axes else x


def _grouped_rows(x, q_shape, fill):
    """Row statistics [B, T, N] as [B, K, G, Tp], for queries grouped as q_shape [B, Tp, K, G, H]."""
    b, tp, kv_heads, g, _ = q_shape
    return _pad_axis(x, 1, tp, fill).reshape(b, tp, kv_heads, g).transpose(0, 2, 3, 1)


def _lse_shift(lse, q_shape):
    """The grouped lse that probabilities are recomputed against, exp(S - shift): 0 for rows that
    see no key (every S is -inf there, so every p is exp(-inf) = 0, not NaN)."""
    lse = _grouped_rows(lse, q_shape, -jnp.inf)
    return jnp.where(lse == -jnp.inf, 0.0, lse)


def _backward(cfg, plan, ops, out, lse, d_out, d_lse):
    b, tp, kv_heads, g, h = ops.q.shape
    t = out.shape[1]
    acc = _acc_dtype(ops.q.dtype)
    dtype = ops.q.dtype

    inputs = (*_present(ops), out, lse, d_out, d_lse)
    # D = rowsum(dO * O); a cotangent on the log-sum-exp enters as -dLSE (dLSE/dS = P).
    delta = jnp.sum(d_out.astype(acc) * out.astype(acc), axis=-1) - d_lse.astype(acc)
    delta = _grouped_rows(delta, ops.q.shape, 0.0)
    lse = _lse_shift(lse.astype(acc), ops.q.shape)
    d_out = _pad_axis(d_out, 1, tp).reshape(b, tp, kv_heads, g, d_out.shape[3])  # [.., Hv]

    def q_block_step(carry, iq):
        rows = lambda x: lax.dynamic_slice_in_dim(x, iq * plan.block_q, plan.block_q, axis=1)  # noqa: E731
        cols = lambda x: lax.dynamic_slice_in_dim(x, iq * plan.block_q, plan.block_q, axis=3)  # noqa: E731
        q_block, do_block, lse_block, delta_block = rows(ops.q), rows(d_out), cols(lse), cols(delta)

        def step(jk, c):
            dq, dk, dv, dbias = c
            k0 = jk * plan.block_k
            s, tanh_s = _logits(cfg, plan, ops, q_block, iq, jk)
            p = jnp.exp(s - lse_block[..., None])
            k_block = lax.dynamic_slice_in_dim(ops.k, k0, plan.block_k, axis=1)
            v_block = lax.dynamic_slice_in_dim(ops.v, k0, plan.block_k, axis=1)
            dv_tile = jnp.einsum("bkgqs,bqkgh->bskh", p.astype(dtype), do_block,
                                 preferred_element_type=acc)  # fmt: skip
            dp = jnp.einsum("bqkgh,bskh->bkgqs", do_block, v_block, preferred_element_type=acc)
            ds = p * (dp - delta_block[..., None])
            if dbias is not None:
                tile = _reduce_to(ds, dbias.shape)
                q0 = iq * plan.block_q if dbias.shape[3] > 1 else 0
                k0b = k0 if dbias.shape[4] > 1 else 0
                old = lax.dynamic_slice(dbias, (0, 0, 0, q0, k0b), tile.shape)
                dbias = lax.dynamic_update_slice(dbias, old + tile, (0, 0, 0, q0, k0b))
            if tanh_s is not None:
                ds = ds * (1.0 - tanh_s * tanh_s)
            ds = (ds * cfg.scale).astype(dtype)
            dq = dq + jnp.einsum("bkgqs,bskh->bqkgh", ds, k_block, preferred_element_type=acc)
            dk_tile = jnp.einsum("bkgqs,bqkgh->bskh", ds, q_block, preferred_element_type=acc)
            dk = lax.dynamic_update_slice_in_dim(
                dk, lax.dynamic_slice_in_dim(dk, k0, plan.block_k, 1) + dk_tile, k0, axis=1)
            dv = lax.dynamic_update_slice_in_dim(
                dv, lax.dynamic_slice_in_dim(dv, k0, plan.block_k, 1) + dv_tile, k0, axis=1)
            return dq, dk, dv, dbias

        lo, hi = _key_block_range(cfg, plan, iq)
        (dq0,) = vary_like((zeros_like(q_block, acc),), *inputs)
        dq, dk, dv, dbias = lax.fori_loop(lo, hi, step, (dq0,) + carry)
        return (dk, dv, dbias), dq.reshape(b, plan.block_q, kv_heads * g, h)

    # zeros_like, not zeros: under explicit sharding the accumulators take the shardings of k and
    # the bias, which the updates in the loop carry. Inside shard_map they vary over the mesh axes
    # of every input (with one kv head and the query heads split, each device's dK is a part).
    dbias0 = None if ops.bias is None else vary_like((zeros_like(ops.bias, acc),), *inputs)[0]
    zeros_k, zeros_v = vary_like((zeros_like(ops.k, acc), zeros_like(ops.v, acc)), *inputs)
    (dk, dv, dbias), dq = lax.scan(q_block_step, (zeros_k, zeros_v, dbias0),
                                   jnp.arange(plan.num_q_blocks))  # fmt: skip
    return _unblock(dq, t).astype(dtype), dk, dv, dbias


def _tangent_q_block(cfg, plan, ops, tops, out, lse, all_key_blocks, iq):
    """Forward-mode tangents of one query block: with P = exp(S - lse) and dS the logits'
    tangent, d_lse = sum_j P dS and d_out = sum_j P (dS V + dV) - d_lse O. `all_key_blocks`: a
    loop over every key block, not the band's (static bounds, which reverse mode goes through)."""
    acc = _acc_dtype(ops.q.dtype)
    rows = lambda x: lax.dynamic_slice_in_dim(x, iq * plan.block_q, plan.block_q, axis=1)  # noqa: E731
    q_block, tq_block = rows(ops.q), rows(tops.q)
    lse_block = lax.dynamic_slice_in_dim(lse, iq * plan.block_q, plan.block_q, axis=3)

    def step(jk, carry):
        d_lse, u = carry
        k0 = jk * plan.block_k
        blocks = lambda x: lax.dynamic_slice_in_dim(x, k0, plan.block_k, axis=1)  # noqa: E731
        k_block, v_block, tk_block, tv_block = blocks(ops.k), blocks(ops.v), blocks(tops.k), blocks(tops.v)
        s, tanh_s = _logits(cfg, plan, ops, q_block, iq, jk)
        p = jnp.exp(s - lse_block[..., None])  # 0 where not visible
        ds = (jnp.einsum("bqkgh,bskh->bkgqs", tq_block, k_block, preferred_element_type=acc)
              + jnp.einsum("bqkgh,bskh->bkgqs", q_block, tk_block, preferred_element_type=acc)) * cfg.scale
        if tanh_s is not None:
            ds = ds * (1.0 - tanh_s * tanh_s)
        if tops.bias is not None:
            ds = ds + _tile(tops.bias, iq * plan.block_q, plan.block_q, k0, plan.block_k).astype(acc)
        pds = jnp.where(p > 0, p * ds, 0.0)  # no tangent from a pair that takes no part
        u = u + jnp.einsum("bkgqs,bskh->bkgqh", pds.astype(ops.v.dtype), v_block, preferred_element_type=acc)
        u = u + jnp.einsum("bkgqs,bskh->bkgqh", p.astype(ops.v.dtype), tv_block, preferred_element_type=acc)
        return d_lse + pds.sum(-1), u

    o_block = rows(out).transpose(0, 2, 3, 1, 4).astype(acc)  # [B, K, G, bq, Hv]
    init = vary_like((zeros_like(o_block[..., 0], acc), zeros_like(o_block, acc)), *_present(ops), *_present(tops))
    lo, hi = (0, plan.num_k_blocks) if all_key_blocks else _key_block_range(cfg, plan, iq)
    d_lse, u = lax.fori_loop(lo, hi, step, init)
    d_out = u - d_lse[..., None] * o_block
    b, _, kv_heads, g, _ = ops.q.shape
    d_out = d_out.transpose(0, 3, 1, 2, 4).reshape(b, plan.block_q, kv_heads * g, -1)
    d_lse = d_lse.transpose(0, 3, 1, 2).reshape(b, plan.block_q, kv_heads * g)
    return d_out.astype(out.dtype), d_lse.astype(lse.dtype)


def _tangent(static: _Static, primals, out, lse, tangents, all_key_blocks=False):
    """(d_out, d_lse) of a call for tangents of q, k, v (and the bias, where there is one)."""
    call = _call_from(static, primals)
    tq, tk, tv, *tb = tangents
    ops = _operands(call, static.plan)
    tops = _operands(dataclasses.replace(call, query=tq, key=tk, value=tv, bias=tb[0] if tb else None), static.plan)
    b, tp, kv_heads, g, _ = ops.q.shape
    grouped_out = _pad_axis(out, 1, tp).reshape(b, tp, kv_heads, g, out.shape[3])
    d_out, d_lse = lax.map(functools.partial(_tangent_q_block, static.config, static.plan, ops, tops,
                                             grouped_out, _lse_shift(lse, ops.q.shape), all_key_blocks),
                           jnp.arange(static.plan.num_q_blocks))  # fmt: skip
    return _unblock(d_out, static.t), _unblock(d_lse, static.t)


# ---- differentiation: a custom_jvp whose tangent transposes to the backward above -------------


class _Static(NamedTuple):
    config: AttentionConfig
    plan: _Plan
    t: int
    s: int


DIFFERENTIABLE = (0, 1, 2, 3)  # q, k, v and the bias, of (q, k, v, bias, mask, lengths, segment ids)


def _args(call: Call) -> tuple:
    """A call's arrays in _flash's order (the inverse of _call_from)."""
    return (call.query, call.key, call.value, call.bias, call.mask, call.query_seq_lengths,
            call.key_value_seq_lengths, call.q_segment_ids, call.kv_segment_ids)  # fmt: skip


def _call_from(static: _Static, args) -> Call:
    q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg = args
    return Call(q, k, v, bias, mask, q_len, kv_len, q_seg, kv_seg, static.config, True)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _flash(static: _Static, *args):
    ops = _operands(_call_from(static, args), static.plan)
    return _forward(static.config, static.plan, ops, static.t)


@_flash.defjvp
def _flash_jvp(static: _Static, primals, tangents):
    out, lse = _flash(static, *primals)
    layout = _tangent_map.layout_of(primals, DIFFERENTIABLE)
    d_out, d_lse = _TANGENT(static, layout, primals, out, lse, [tangents[i] for i in layout.differentiable])
    return (out, lse), (d_out, d_lse)


def _transpose(static: _Static, primals, out, lse, d_out, d_lse, needed):
    dq, dk, dv, dbias = _gradients(static, _call_from(static, primals), out, lse, d_out, d_lse)
    return (dq, dk, dv) if dbias is None else (dq, dk, dv, dbias)


def _gradients(static: _Static, call: Call, out, lse, d_out, d_lse):
    """(dq, dk, dv, dbias) of a call, from its output and log-sum-exp."""
    ops = _operands(call, static.plan)
    dq, dk, dv, dbias = _backward(static.config, static.plan, ops, out, lse, d_out, d_lse)
    s, dtype = static.s, call.query.dtype
    dk, dv = dk[:, :s].astype(dtype), dv[:, :s].astype(dtype)
    if dbias is not None:
        bias = call.bias  # undo the (K, G) split and the padding of T and S
        dbias = dbias.reshape(dbias.shape[:1] + (-1,) + dbias.shape[3:])
        dbias = dbias[:, :, : bias.shape[2], : bias.shape[3]].astype(bias.dtype)
    return dq, dk, dv, dbias


_TANGENT = _tangent_map.TangentMap("jax_flash_xla_attention_tangent", _tangent, _transpose,
                                   functools.partial(_tangent, all_key_blocks=True))


def _static(call: Call, block_q: int, block_k: int) -> _Static:
    t, s = call.query.shape[1], call.key.shape[1]
    return _Static(call.config, _make_plan(t, s, offset_per_row(call), block_q, block_k), t, s)


def offset_per_row(call: Call) -> bool:
    """Whether the diagonal offset differs between batch rows (by their lengths)."""
    has_lengths = call.query_seq_lengths is not None or call.key_value_seq_lengths is not None
    return has_lengths and call.config.diagonal_by_lengths


def attention(
    call: Call, block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K
) -> tuple[jax.Array, jax.Array]:
    """Blockwise attention of a validated call: (output [B, T, N, H], lse [B, T, N]).

    lse is float32 (float64 for float64 inputs)."""
    return _flash(_static(call, block_q, block_k), *_args(call))


def tangent(call: Call, out, lse, tangents, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K, all_key_blocks=False):
    """Forward mode alone: (d_out, d_lse) of a call from its output and lse [B, T, N], for
    tangents (dq, dk, dv, dbias or None). The CUDA path's forward-mode AD runs it."""
    present = tangents if call.bias is not None else tangents[:3]
    return _tangent(_static(call, block_q, block_k), _args(call), out, lse, present, all_key_blocks)


def backward(call: Call, out, lse, d_out, d_lse, block_q=DEFAULT_BLOCK_Q, block_k=DEFAULT_BLOCK_K):
    """The blockwise backward alone, from a forward's output and lse [B, T, N] (float32 for
    float16/bfloat16 inputs): (dq, dk, dv, dbias). Ring attention's xla path runs it with the
    output and lse of the whole sequence."""
    return _gradients(_static(call, block_q, block_k), call, out, lse, d_out, d_lse)
