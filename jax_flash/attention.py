"""The public function `jax_flash.attention`: documentation, validation, choice of implementation."""

from __future__ import annotations

from typing import Literal, overload

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jax_flash import _fp8, _sinks, cuda_impl, cudnn_fallback, dense_impl, xla_impl
from jax_flash._validation import Call, validate


@overload
def attention(
    query: ArrayLike, key: ArrayLike, value: ArrayLike,
    bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
    scale: float | None = None, is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None, key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Literal["xla", "cuda"] | None = None,
    return_residual: Literal[False] = False, softcap: float | None = None,
    q_segment_ids: ArrayLike | None = None, kv_segment_ids: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    key_scale: ArrayLike | None = None, value_scale: ArrayLike | None = None,
) -> jax.Array: ...  # fmt: skip


@overload
def attention(
    query: ArrayLike, key: ArrayLike, value: ArrayLike,
    bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
    scale: float | None = None, is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None, key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: Literal["xla", "cuda"] | None = None,
    return_residual: Literal[True] = ..., softcap: float | None = None,
    q_segment_ids: ArrayLike | None = None, kv_segment_ids: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    key_scale: ArrayLike | None = None, value_scale: ArrayLike | None = None,
) -> tuple[jax.Array, jax.Array]: ...  # fmt: skip


def attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    implementation=None,
    return_residual=False,
    softcap=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    sinks=None,
    key_scale=None,
    value_scale=None,
):
    r"""Scaled dot-product attention, computed blockwise (FlashAttention) in O(seqlen) memory.

    A drop-in for `jax.nn.dot_product_attention` (same argument names, shapes and meaning), with
    three extras (`softcap`, segment ids, `sinks`). For each head it computes::

        logits = softcap * tanh(scale * Q K^T / softcap) + bias     (without softcap: scale * Q K^T + bias)
        output = softmax(where(visible, logits, -inf)) V

    Shape letters::

        B batch   T query length   S key/value length   N query heads
        K key/value heads (N % K == 0; K < N is GQA, K == 1 is MQA)   H head dim
        Hv value head dim (H unless given otherwise)

    Args:
      query: `[B, T, N, H]` (or `[T, N, H]`), float16, bfloat16, float32 or float64.
      key: `[B, S, K, H]`, same dtype as `query`.
      value: `[B, S, K, Hv]`, same dtype as `key`. Its head dim `Hv` may differ from the
        query/key head dim `H` (as in DeepSeek's multi-head latent attention, 192 and 128), which
        goes beyond `jax.nn.dot_product_attention` (it requires `Hv == H`); the output is then
        `[B, T, N, Hv]`, and `scale` still defaults to `1 / sqrt(H)`.
      bias: optional float array added to the logits, broadcastable to `[B, N, T, S]` (each axis
        1 or full size). Differentiable.
      mask: optional boolean array (or scalar), broadcastable to `[B, N, T, S]`; `True` means
        attend. Keys hidden only by a mask or by other documents' segment ids may share a kernel
        tile with keys that other rows see, so a NaN in them spreads as in `jax.nn`. A
        mask along the keys alone (`[B, 1, 1, S]`, padding) or the queries alone runs in the
        kernels as segment ids: the key blocks it hides are skipped, not read.
      scale: logit scale; default `1 / sqrt(H)`.
      is_causal: causal mask. When `T != S` the diagonal is aligned bottom-right: query `i` sees
        keys `j <= i + (S - T)`, so the last query sees every key (as FlashAttention 2.1+).
      query_seq_lengths: int `[B]`; query rows at or past the length are padding (output 0).
      key_value_seq_lengths: int `[B]`; keys at or past the length are ignored: never read into
        an output or a gradient, so a NaN or inf there changes nothing. Lengths are clamped into
        `[0, T]` and `[0, S]` (values beyond int32 too, before any cast). Where the lengths move
        the causal diagonal and windows: with `T == S` they do not (query `i` is at key position
        `i`, as in `jax.nn`: a right-padded batch); with `T != S` the last valid query aligns
        with the last valid key, i.e. query `i` of batch row `b` sits at key position
        `i + kv_len[b] - q_len[b]` (`q_len[b] = T` without query lengths: the queries are the
        last `T` tokens of a cache holding `kv_len[b]`).
      local_window_size: `w` or `(left, right)`: query `i` sees keys within `left` before and
        `right` after its diagonal position (combined with `is_causal`, `right` becomes 0). Sides
        beyond `S + T` are clipped to it (no key is further away): `2**31 - 1` is unbounded.
      implementation: `None` (the CUDA kernels on a CUDA GPU when they support the call; else, on
        a CUDA GPU, `jax.nn`'s cuDNN attention for calls it computes alike: plain, causal or
        windowed with T == S, no bias, mask, lengths, soft cap or segment ids; else `"xla"`),
        `"cuda"` (raises `ValueError` when the kernels cannot run the call) or `"xla"` (pure JAX,
        any backend).
      return_residual: also return the log-sum-exp of the visible logits, `[B, T, N]` float32
        (float64 for float64 inputs).
      softcap: optional logit soft cap (> 0 and at most 1e30), as in Gemma 2.
      q_segment_ids: int `[B, T]`; with `kv_segment_ids` (int `[B, S]`), a query sees only keys
        of its own segment (packed documents).
      sinks: optional float `[N]`, one logit per query head (gpt-oss's attention sinks): it joins
        every row's softmax as a key with no value, `output = sum_j e^{l_j} v_j / (e^{sink} +
        sum_j e^{l_j})`, used as given (no scale, cap or bias), in float32. Differentiable. The
        log-sum-exp of `return_residual` then includes it; a row that sees no key gets output 0
        and lse = its sink. The kernels join it in their softmax finish (decode's: in the
        combine of its splits), the backward through the lse; the xla path and cuDNN-less others
        join it once from the lse (jax_flash/_sinks.py).
      key_scale, value_scale: with `key` and `value` in `float8_e4m3fn` or `float8_e5m2` (both the
        same; a KV cache written by `jax_flash.quantize_kv`), float32 scalars or `[K]` (one per kv
        head), default 1: the keys and values used are `key.astype(float32) * key_scale` and
        likewise. The query stays float16/bfloat16 (or float32/float64), and so does the output.
        On a GPU from sm_80 on the decode kernels read the cache as stored (at most 16 queries,
        key lengths as the only mask, head dims 64 and 128: half a bf16 cache's bytes); every other
        call converts the keys and values to the query's dtype first (one elementwise pass, 1 byte
        read and 2 written a value, then the usual kernels or the xla path). Such a call is
        forward only (differentiating it raises a `ValueError`). Beyond `jax.nn`.

    A query row that sees no key (padding, segments, windows, masks) gets output 0 and
    log-sum-exp `-inf`, and passes no gradient; never NaN. Empty inputs are taken as
    `jax.nn.dot_product_attention` takes them: `B`, `T`, `N` or `H` of 0 give an empty output,
    `S` of 0 an output of zeros (every row empty), all with zero gradients.

    Returns:
      The output, `[B, T, N, Hv]` (shaped like `query` when `Hv == H`) in the dtype of `query`; with
      `return_residual`, `(output, lse)`.
    """
    if _fp8.is_fp8(key) or _fp8.is_fp8(value) or key_scale is not None or value_scale is not None:
        key_scale, value_scale = _fp8.check(query, key, value, key_scale, value_scale)
        if key_scale is not None:
            options = dict(mask=mask, scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                           key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
                           implementation=implementation, return_residual=return_residual, softcap=softcap,
                           q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)  # fmt: skip
            return _over_fp8(query, key, value, bias, sinks, key_scale, value_scale, options)
    call = validate(
        query, key, value, bias, mask,
        scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
        implementation=implementation, return_residual=return_residual, softcap=softcap,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
    )  # fmt: skip
    return attend(call, implementation, return_residual, _sinks.check(sinks, call.query.shape[2]))


def _over_fp8(query, key, value, bias, sinks, key_scale, value_scale, options: dict):
    """`attention` over fp8 keys and values: read as stored by the decode kernels where they take
    the call (fp8_decode_call), else converted to the query's dtype and attended; forward only. The
    differentiable float inputs are the custom_jvp's arguments (the integer and boolean ones stay
    in `options`), so that any derivative asked of the call is refused."""

    def over_converted(query, key, value, bias, sinks, key_scale, value_scale):
        if (call := fp8_decode_call(query, key, value, bias, options)) is not None:
            out, lse = cuda_impl.fp8_decode(call, key_scale, value_scale, _sinks.check(sinks, call.query.shape[2]))
            return _result(call, out, lse, options["return_residual"])
        key, value = _fp8.dequantize_pair(key, value, key_scale, value_scale, query.dtype)
        return attention(query, key, value, bias, sinks=sinks, **options)

    return _fp8.forward_only(over_converted, jnp.asarray(query), key, value, bias, sinks, key_scale, value_scale)


def fp8_decode_call(query, key, value, bias, options: dict) -> Call | None:
    """The validated call over an fp8 cache where the decode kernels read it as stored
    (cuda_impl.fp8_decode_reason), else None: it is converted first."""
    if options["implementation"] == "xla":
        return None
    rest = {name: x for name, x in options.items() if name != "mask"}
    call = validate(query, key, value, bias, options["mask"], fp8_cache=True, **rest)
    if has_nothing_to_compute(call) or cuda_impl.fp8_decode_reason(call) is not None:
        return None
    return call


def attend(call: Call, implementation: str | None, return_residual: bool, sinks=None):
    """`attention` of a validated call (paged_attention's gathered caches come in here too), with
    checked `sinks` or None: in the kernels' softmax finish, or joined from the lse of the other
    paths (which then return it: cuDNN's does not, so it is out)."""
    path, out = route(call, implementation, return_residual or sinks is not None)
    if path == "cuda":
        out, lse = cuda_impl.attention(call, strict=implementation == "cuda", sinks=sinks)
    else:
        if path == "none":
            out, lse = nothing_computed(call)
        elif path == "cudnn":
            lse = None  # not asked for (cudnn_fallback)
        else:
            out, lse = xla_path(call)
        if sinks is not None:
            out, lse = _sinks.apply(out, lse, sinks)
    return _result(call, out, lse, return_residual)


def _result(call: Call, out, lse, return_residual: bool):
    """What `attention` returns: out, or (out, lse), without the batch axis where the call had none."""
    if not call.batched:
        out, lse = out[0], lse[0]
    return (out, lse) if return_residual else out


def route(call: Call, implementation: str | None, return_residual: bool) -> tuple[str, jax.Array | None]:
    """The path of a validated call, "none", "cuda", "cudnn" (with cuDNN's output) or "xla", in
    the order auto mode tries them. On data-centre Blackwell (10.x) cuDNN comes first for the calls
    it computes alike: our kernels run there as mma.sync code JIT-compiled from PTX, a fraction of
    what those tensor cores give cuDNN (cuda_impl.cudnn_first)."""
    if has_nothing_to_compute(call):
        return "none", None
    if implementation is None and cuda_impl.cudnn_first() and (out := cudnn_output(call, None, return_residual)) is not None:
        return "cudnn", out
    if takes_kernels(call, implementation):
        return "cuda", None
    if (out := cudnn_output(call, implementation, return_residual)) is not None:
        return "cudnn", out
    return "xla", None


def chosen_implementation(query, key, value, bias=None, mask=None, **kwargs) -> str:
    """Which path `attention` takes for these arguments (the same ones, arrays or
    `jax.ShapeDtypeStruct`s): "cuda", "cudnn" (`jax.nn`'s, on a GPU whose calls the kernels cannot
    run: cudnn_fallback.py), "xla-dense" (the scores formed whole, within the memory budget),
    "xla-blockwise" (O(seqlen) memory) or "none" (empty inputs: nothing to compute)."""
    reasons = []

    def trace(query, key, value, bias, mask):
        options = _with_defaults(kwargs)
        sinks, key_scale, value_scale = (options.pop(name) for name in ("sinks", "key_scale", "value_scale"))
        key_scale, value_scale = _fp8.check(query, key, value, key_scale, value_scale)
        if key_scale is not None:
            if fp8_decode_call(query, key, value, bias, {**options, "mask": mask}) is not None:
                reasons.append("cuda")
                return query
            key, value = _fp8.dequantize_pair(key, value, key_scale, value_scale, query.dtype)
        call = validate(query, key, value, bias, mask, **options)
        sinks = _sinks.check(sinks, call.query.shape[2])
        # With sinks every path returns its lse (cuDNN's does not).
        path, _ = route(call, options["implementation"], options["return_residual"] or sinks is not None)
        if path == "xla":
            path = "xla-dense" if dense_impl.fits(call) else "xla-blockwise"
        reasons.append(path)
        return query

    jax.eval_shape(trace, query, key, value, bias, mask)
    return reasons[0]


_OPTIONS = dict(scale=None, is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                local_window_size=None, implementation=None, return_residual=False, softcap=None,
                q_segment_ids=None, kv_segment_ids=None, sinks=None, key_scale=None, value_scale=None)  # fmt: skip


def _with_defaults(kwargs: dict) -> dict:
    unknown = set(kwargs) - set(_OPTIONS)
    if unknown:
        raise TypeError(f"unexpected keyword arguments {sorted(unknown)}; allowed: {sorted(_OPTIONS)}")
    return {**_OPTIONS, **kwargs}


def has_nothing_to_compute(call: Call) -> bool:
    """No query rows (B, T or N is 0) or no keys (S = 0). (H = 0 has logits, all 0, and a
    log-sum-exp: the usual paths compute it.)"""
    b, t, n, _ = call.query.shape
    return b * t * n == 0 or call.key.shape[1] == 0


def nothing_computed(call: Call) -> tuple[jax.Array, jax.Array]:
    """The result of a call with nothing to compute, as `jax.nn.dot_product_attention` gives it:
    with no keys every row is empty (output 0, log-sum-exp -inf). Nothing depends on the inputs,
    so every gradient is 0."""
    q = call.query
    lse_dtype = jnp.promote_types(q.dtype, jnp.float32)
    return jnp.zeros(q.shape[:3] + call.value.shape[3:], q.dtype), jnp.full(q.shape[:3], -jnp.inf, lse_dtype)


def xla_path(call: Call) -> tuple[jax.Array, jax.Array]:
    """The `xla` path: dense where the T x S scores fit the memory budget (dense_impl.py), else
    blockwise in O(seqlen) memory."""
    return dense_impl.attention(call) if dense_impl.fits(call) else xla_impl.attention(call)


def cudnn_output(call: Call, implementation: str | None, return_residual: bool) -> jax.Array | None:
    """In auto mode, for a call the kernels refused: `jax.nn`'s cuDNN attention where it computes
    what we define (cudnn_fallback.py), else None (the xla path)."""
    if implementation is not None or cudnn_fallback.reason(call, return_residual) is not None:
        return None
    return cudnn_fallback.attention(call)


def takes_kernels(call: Call, implementation: str | None) -> bool:
    """Whether `attention` runs a validated call on the kernels: where `uses_cuda` says they can,
    but in auto mode not where the xla path's dense formulation is faster (cuda_impl.dense_is_faster;
    the ring's blocks ask `uses_cuda` alone, their other path being the blockwise one)."""
    return uses_cuda(call, implementation) and (implementation == "cuda" or not cuda_impl.dense_is_faster(call))


def uses_cuda(call: Call, implementation: str | None) -> bool:
    """Whether a validated call runs on the CUDA kernels (`None`: wherever they support it);
    `implementation="cuda"` raises a `ValueError` naming what they cannot do."""
    if implementation == "xla":
        return False
    reason = cuda_impl.unsupported_reason(call)
    if implementation == "cuda" and reason is not None:
        raise ValueError(f"implementation='cuda' cannot run this call: {reason}")
    return reason is None
