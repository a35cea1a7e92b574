"""The `implementation="cuda"` path: our CUDA kernels behind XLA FFI custom calls.

`unsupported_reason` is the one place that decides which calls the kernels take; `attention`
pads the head dim up to one with kernels, then runs a `custom_jvp` whose forward is an
`jax.ffi.ffi_call` and whose tangent transposes into the backward's (the FFI calls themselves
live in `_ffi.py`; the tangent primitive in `_tangent.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import warnings

import jax
import jax.numpy as jnp

from jax_flash import _contract, _decode, _ffi, _plan, _ragged_work, _tangent, dense_impl, xla_impl
from jax_flash._plan import Family, kernel_head_dim
from jax_flash._masks import KernelMasks, kernel_masks
from jax_flash._validation import AttentionConfig, Call

FWD_HEAD_DIMS = _contract.FWD_HEAD_DIMS
BWD_HEAD_DIMS = _contract.BWD_HEAD_DIMS  # 192 runs the 256 kernels, zero-padded, but on Hopper's own
# without a bias or mask (_plan.backward_head_dims, which also has the (192, 128) pairs').
# Above 256: the forward alone (Hopper's or the mma.sync one; no bias or mask); the gradients from
# the xla path's backward. Above 512 Hopper's alone (pairs of CTAs that split the head dim).
WIDE_FWD_HEAD_DIMS = _contract.FWD_SM90_WIDE_HEAD_DIMS
SM80_WIDE_FWD_HEAD_DIMS = _contract.FWD_SM80_WIDE_HEAD_DIMS
assert WIDE_FWD_HEAD_DIMS[: len(SM80_WIDE_FWD_HEAD_DIMS)] == SM80_WIDE_FWD_HEAD_DIMS, "the mma.sync ones are Hopper's first"
KERNEL_DTYPES = (jnp.float16, jnp.bfloat16)
MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z
# The oldest GPU our kernel families run on: Turing (7.5), whose family (fp16 only, no bf16 tensor
# cores) takes head dims up to 128 (TURING_HEAD_DIMS, smaller ones padded up) without a bias.
# Blackwell and later run the mma.sync kernels from the PTX of the default build (not tested on
# such a GPU). Which GPUs an install has code for is _ffi.has_machine_code's question (its
# targets, e.g. sm_75, sm_80, sm_90a and compute_80's PTX).
MIN_KERNEL_CAPABILITY = (7, 5)
TURING_HEAD_DIMS = _contract.FWD_SM75_HEAD_DIMS
assert TURING_HEAD_DIMS == _contract.BWD_SM75_HEAD_DIMS, "the Turing backward takes its forward's head dims"


def grid_fits(batch_heads: int) -> bool:
    """Whether the launchers can split batch x heads into grid y x z exactly, each at most 65,535,
    within the kernels' 32-bit index (the rule of `batch_head_grid` in cuda/common/grid.cuh)."""
    if batch_heads > 2**31 - 1:
        return False
    smallest_y = -(-batch_heads // MAX_GRID_YZ)
    return any(batch_heads % y == 0 for y in range(min(batch_heads, MAX_GRID_YZ), smallest_y - 1, -1))


REINSTALL = ("reinstall jax_flash where a CUDA compiler can be had (a CUDA toolkit, or PyPI's, which "
             "`pip install \"jax[cuda13]\"` brings): `pip install --force-reinstall --no-deps jax_flash`, or "
             "`pip install -e .` in a checkout; `python -m jax_flash.info` says what is installed")


def install_reason() -> str | None:
    """Why no kernel of this install runs on the default device, or None where they can."""
    if _ffi.extension() is None:
        return "jax_flash was installed without its CUDA extension (no CUDA compiler at build time)"
    if not _ffi.cuda_device_available():
        return "the default JAX backend is not a CUDA GPU"
    major, minor = _ffi.device_capability()
    if (major, minor) < MIN_KERNEL_CAPABILITY:
        return f"the kernels need compute capability 7.5 or newer (Turing and later); this GPU is {major}.{minor}"
    family = _plan.family()
    archs = _plan.family_archs(family)
    if not _ffi.has_machine_code((major, minor), archs):
        kernels = "its Turing kernels have" if family is Family.TURING else "it has"
        listed = f"sm_{', sm_'.join(archs)}" if archs else "no target"
        return (f"as installed, jax_flash's kernels cannot run here: {kernels} machine code for {listed}, none of "
                f"which runs on this GPU ({major}.{minor}); reinstall with JAX_FLASH_CUDA_ARCHS=native or a list "
                "with it")
    return None


@functools.cache
def warn_if_kernels_missing() -> None:
    """Once a process, on a CUDA GPU of a generation we have kernels for where this install has
    none that run: say why, and how to get them (otherwise every call quietly takes cuDNN or the
    xla path)."""
    if not _ffi.cuda_device_available() or _ffi.device_capability() < MIN_KERNEL_CAPABILITY:
        return
    reason = install_reason()
    if reason is not None:
        warnings.warn(f"jax_flash: {reason}, so calls take cuDNN or the xla path; {REINSTALL}", RuntimeWarning,
                      stacklevel=_caller_stacklevel())  # fmt: skip


def _caller_stacklevel() -> int:
    """The stack level of the first frame outside jax_flash and JAX (the user's call, also from
    inside a jitted function), for warnings.warn called from here."""
    internal = tuple(os.path.dirname(m.__file__) for m in (jax, sys.modules[__name__.split(".")[0]]))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame, level = frame.f_back, level + 1
    return level


def family_name(capability: tuple[int, int]) -> str:
    """Which of this install's kernel families a GPU of `capability` runs (python -m jax_flash.info)."""
    if _ffi.extension() is None:
        return "none: installed without the CUDA extension"
    if capability < MIN_KERNEL_CAPABILITY:
        return "none: the kernels need compute capability 7.5 or newer"
    family = _plan.family_of(capability, _ffi.built_archs())
    archs = _plan.family_archs(family)
    if family is Family.TURING:
        name = "Turing (mma.sync m16n8k8, fp16)"
    elif family is Family.HOPPER:
        name = "Hopper (wgmma + TMA), with the mma.sync family for the rest"
    else:
        name = "mma.sync (sm_80 and later)"
    if not _ffi.has_machine_code(capability, archs):
        return f"none: no machine code or PTX of this install ({', '.join(archs)}) runs on {capability[0]}.{capability[1]}"
    jit = not any(_ffi.has_machine_code(capability, (a,)) for a in archs if not a.endswith("-virtual"))
    return name + (" JIT-compiled from PTX" if jit else "") + ("; auto mode tries cuDNN first" if capability[0] == 10 else "")


def cudnn_first() -> bool:
    """Whether auto mode tries cuDNN before the kernels: on 10.x GPUs (data-centre Blackwell), where
    our kernels would be mma.sync code JIT-compiled from PTX (12.x runs mma.sync natively)."""
    return _ffi.cuda_device_available() and _ffi.device_capability()[0] == 10


def unsupported_reason(call: Call) -> str | None:
    """Why the CUDA kernels cannot run `call`, or None when they can."""
    warn_if_kernels_missing()
    if (reason := install_reason()) is not None:
        return reason
    family = _plan.family()
    if call.query.dtype not in KERNEL_DTYPES:
        return f"the kernels take float16 or bfloat16, got {call.query.dtype}"
    if family is Family.TURING and (reason := _turing_reason(call)):
        return reason
    widest = _widest_head_dim(call)
    if kernel_head_dim(widest, FWD_HEAD_DIMS + WIDE_FWD_HEAD_DIMS) is None:
        return f"head dim {widest} is above the largest supported ({WIDE_FWD_HEAD_DIMS[-1]})"
    if widest > FWD_HEAD_DIMS[-1] and (reason := _wide_reason(call, family)):
        return reason
    if call.config.scale <= 0:
        return "the kernels need scale > 0"
    b, n, kv_heads = call.query.shape[0], call.query.shape[2], call.key.shape[2]
    for heads in {n, kv_heads}:
        if not grid_fits(b * heads):
            return (f"batch x heads ({b} x {heads} = {b * heads}) has no split into the CUDA grid's y x z "
                    f"of at most {MAX_GRID_YZ} each")
    return None


def dense_is_faster(call: Call) -> bool:
    """Auto mode's one choice by speed: whether the xla path's dense formulation outruns the
    kernels on a call they can run. Above head dim 512 the kernels are pairs of CTAs bounded by the
    L2 near 500 TFLOP/s, while XLA's dense products run faster where every score is computed anyway
    (H200, 8k, bf16, non-causal forward: d = 640 323 TFLOP/s against 453, 1024 395 against 542;
    causal the pair wins, 369 against 222; docs/perf/log.md, W8). So: a pair head dim, every score
    visible (no causal mask, window, lengths or segment ids; a bias or mask takes the xla path
    there anyway), and scores that fit the dense formulation's memory budget."""
    every_score_visible = not dense_impl.is_banded(call) and not dense_impl.per_batch_row(call)
    return _widest_head_dim(call) > SM80_WIDE_FWD_HEAD_DIMS[-1] and every_score_visible and dense_impl.fits(call)


def _turing_reason(call: Call) -> str | None:
    """Why the Turing family (on sm_75, or forced with JAX_FLASH_KERNELS=sm75) cannot run `call`, or None."""
    widest = _widest_head_dim(call)
    if call.query.dtype != jnp.float16:
        return f"on Turing (sm_75) the kernels take float16 only (no bfloat16 tensor cores), got {call.query.dtype}"
    if widest > TURING_HEAD_DIMS[-1]:
        return f"on Turing (sm_75) the kernels take head dims up to {TURING_HEAD_DIMS[-1]}, got {widest}"
    if not _no_bias_or_2d_mask(call):
        return ("on Turing (sm_75) the kernels take no bias, and no mask that varies along both queries and keys "
                "(a mask along one of them runs as segment ids)")
    return None


def _wide_reason(call: Call, family: Family) -> str | None:
    """Why the forward kernels above head dim 256 (Hopper's, or the mma.sync ones where their
    shared memory fits) cannot run `call`, or None."""
    widest = _widest_head_dim(call)
    if not _no_bias_or_2d_mask(call):
        return (f"head dim {widest} above {FWD_HEAD_DIMS[-1]} runs without a bias, or a mask that varies along "
                "both queries and keys, in the kernels (a mask along one of them runs as segment ids)")
    if family is Family.HOPPER:
        return None
    padded = kernel_head_dim(widest, SM80_WIDE_FWD_HEAD_DIMS)
    if padded is None:
        return (f"head dims above {SM80_WIDE_FWD_HEAD_DIMS[-1]} (got {widest}) run on Hopper's kernels alone (sm_90a, "
                "pairs of thread blocks in a cluster)")
    need, limit = _ffi.extension().sm80_wide_forward_smem_bytes(padded), _ffi.smem_limit()
    if need > limit:
        return (f"the mma.sync forward at head dim {padded} needs {need} bytes of shared memory a block; this GPU "
                f"allows {limit} (the Hopper kernels have no such limit)")
    return None


def _no_bias_or_2d_mask(call: Call) -> bool:
    """No bias, and no mask but one along one axis (which runs as segment ids): what the forwards
    above 256 and of unequal head dims take (and the Hopper backward at 192)."""
    return call.bias is None and (call.mask is None or mask_runs_as_segments(call))


def paged_reason(call: Call, page_size: int) -> str | None:
    """Why the decode kernels cannot read a paged cache in place for `call` (the paged call with
    its pages gathered, as shapes), or None when they can."""
    reason = unsupported_reason(call)
    if reason is not None:
        return reason
    b, t, n, h = call.query.shape
    if not _decode.takes(b, t, n, call.key.shape[2], masks_beyond_key_lengths=False):
        return f"the decode kernels take at most {_decode.MAX_QUERIES} queries (and grids within CUDA's limits)"
    return _pages_in_place_reason("decode", page_size, h, _contract.DECODE_HEAD_DIMS)


def _pages_in_place_reason(kernels: str, page_size: int, head_dim: int, head_dims) -> str | None:
    """Why the split-KV kernels (named `kernels` in the reason) cannot read pages of `page_size`
    tokens at `head_dim` in place, or None: the rules paged and ragged calls share."""
    if _plan.family() is Family.TURING:
        return f"the {kernels} kernels run from sm_80 on"
    if page_size % _decode.BLOCK_KEYS:
        return f"the {kernels} kernels read pages of a multiple of {_decode.BLOCK_KEYS} tokens, got {page_size}"
    if head_dim not in head_dims:
        return f"the {kernels} kernels read head dims {head_dims}, got {head_dim}"
    return None


def paged_attention(config: AttentionConfig, query, key_pages, value_pages, lengths, page_indices, key_scale=None,
                    value_scale=None, sinks=None):  # fmt: skip
    """(output [B, T, N, H], lse [B, T, N]) from the decode kernels reading the pages in place,
    for a call that `paged_reason` accepts (with fp8 pools and their [K] scales, `fp8_decode_reason`),
    `sinks` ([N] or None) joined in the kernels. Forward only."""
    kv_lengths = lengths.astype(jnp.int32)[:, None]  # the kernels clamp them into the pages
    out, lse = _ffi.decode(config, query, key_pages, value_pages, kv_lengths, page_indices, key_scale, value_scale,
                           sinks)  # fmt: skip
    return out, lse.transpose(0, 2, 1)


def ragged_reason(queries, key_pages, sequences: int, scale: float) -> str | None:
    """Why the split-KV kernels cannot run a ragged batch of these shapes (queries [Q, N, H],
    pools [P, page_size, K, H] of q's dtype or fp8, `sequences` rows of the page table), or None
    when they can. Their head dims are decode's, read in place (others would copy the pool)."""
    warn_if_kernels_missing()
    if (reason := install_reason()) is not None:
        return reason
    if queries.dtype not in KERNEL_DTYPES:
        return f"the kernels take float16 or bfloat16 queries, got {queries.dtype}"
    if scale <= 0:
        return "the kernels need scale > 0"
    q_rows, n, h = queries.shape
    _, page_size, kv_heads, _ = key_pages.shape
    fp8 = key_pages.dtype != queries.dtype
    dims = _contract.DECODE_FP8_HEAD_DIMS if fp8 else _contract.DECODE_HEAD_DIMS
    if (reason := _pages_in_place_reason("ragged" + (" fp8" if fp8 else ""), page_size, h, dims)) is not None:
        return reason
    if _ragged_work.items_bound(q_rows, sequences, n // kv_heads) > MAX_GRID_YZ or kv_heads > MAX_GRID_YZ:
        return f"the batch's work list (its query rows x query heads / {_decode.TILE_ROWS}) exceeds the CUDA grid"
    return None


def _prefill_items(queries, key_pages, sequences: int) -> int:
    """The length of a ragged batch's prefill list (0: none): its chunks take the forward kernels'
    tiles over pages in the queries' dtype (those kernels read no fp8) and heads within the grid,
    where the switch is on (_ragged_work.PREFILL_ENV)."""
    if not _ragged_work.prefill_enabled() or key_pages.dtype != queries.dtype or queries.shape[1] > MAX_GRID_YZ:
        return 0
    return _ragged_work.prefill_items_bound(queries.shape[0], sequences)


def ragged_paged_attention(queries, key_pages, value_pages, kv_lengths, page_indices, query_starts, num_seqs,
                           key_scale, value_scale, sinks, *, scale: float, left: int | None, softcap: float | None):
    """(out [Q, N, H], lse [Q, N]) of a ragged batch that `ragged_reason` accepts, from the split-KV
    kernels over its work list and, over 16-bit pages, its prefill chunks on the forward kernels'
    tiles; arguments validated (ragged._check). Rows past the batch's sequences give 0 (lse -inf)
    whatever the kernels left there."""
    q_rows, n, _ = queries.shape
    if q_rows == 0:  # nothing to launch (an empty grid is a launch error)
        return jnp.zeros(queries.shape, queries.dtype), jnp.zeros((0, n), jnp.float32)
    group, sequences = n // key_pages.shape[2], page_indices.shape[0]
    items = _ragged_work.items_bound(q_rows, sequences, group)
    work, prefill_work = _ragged_work.work_list(query_starts, num_seqs, group, items,
                                                _prefill_items(queries, key_pages, sequences))  # fmt: skip
    config = AttentionConfig(scale, left, 0, softcap, True)
    out, lse = _ffi.ragged(config, queries, key_pages, value_pages, kv_lengths, page_indices, work, prefill_work,
                           key_scale, value_scale, sinks)  # fmt: skip
    valid = jnp.arange(q_rows) < query_starts[num_seqs]
    return jnp.where(valid[:, None, None], out, 0), jnp.where(valid[:, None], lse.T, -jnp.inf)


def fp8_decode_reason(call: Call, page_size: int | None = None) -> str | None:
    """Why the decode kernels cannot read the fp8 cache of `call` (validated with `fp8_cache`; with
    `page_size`, the paged call with its pages gathered, as shapes) as it is stored, or None. Where
    they cannot, the cache is converted to the query's dtype first (attention's docstring)."""
    if page_size is not None:
        reason = paged_reason(call, page_size)
    else:
        reason = unsupported_reason(call)
        beyond_key_lengths = _masks_beyond_key_lengths(call)
        if reason is None and not _plan.runs_decode(_plan.family(), call.query.shape, call.key.shape[2],
                                                    call.value.shape[-1], beyond_key_lengths):  # fmt: skip
            reason = (f"the decode kernels take at most {_decode.MAX_QUERIES} queries, key lengths as the only "
                      "mask, from sm_80 on")  # fmt: skip
    if reason is not None:
        return reason
    h, hv = call.query.shape[-1], call.value.shape[-1]
    if h != hv or h not in _contract.DECODE_FP8_HEAD_DIMS:
        return f"the decode kernels read fp8 caches at head dims {_contract.DECODE_FP8_HEAD_DIMS}, got {(h, hv)}"
    return None


def fp8_decode(call: Call, key_scale, value_scale, sinks=None) -> tuple[jax.Array, jax.Array]:
    """(output [B, T, N, H], lse [B, T, N]) of a call that `fp8_decode_reason` accepts, from the
    decode kernels reading its fp8 cache as stored; scales float32 [K]; `sinks` [N] or None.
    Forward only."""
    b = call.query.shape[0]
    kv_len = call.key_value_seq_lengths
    kv_lengths = jnp.zeros((b, 0), jnp.int32) if kv_len is None else kv_len.astype(jnp.int32)[:, None]
    no_pages = jnp.zeros((b, 0), jnp.int32)
    out, lse = _ffi.decode(call.config, call.query, call.key, call.value, kv_lengths, no_pages, key_scale, value_scale,
                           sinks)  # fmt: skip
    return out, lse.transpose(0, 2, 1)


def _masks_beyond_key_lengths(call: Call) -> bool:
    """Whether the call masks anything but key lengths (a bias, a boolean mask, query lengths or
    segment ids), which keeps it off the decode kernels."""
    return any(x is not None for x in (call.bias, call.mask, call.query_seq_lengths, call.q_segment_ids))


def _widest_head_dim(call: Call) -> int:
    """The kernels run query/key and value head dims that differ at the wider of the two, the
    other side zero-padded: zero columns of Q and K change no logit, zero columns of V give output
    columns that are sliced off (and gradients that are)."""
    return max(call.query.shape[-1], call.value.shape[-1])


def plan_of(call: Call) -> _plan.KernelPlan:
    """The kernel plan of a call that `unsupported_reason` accepts (_plan's rules)."""
    return _plan.kernel_plan(_plan.family(), call.query.shape, call.key.shape[2], call.value.shape[-1],
                             not _no_bias_or_2d_mask(call), _masks_beyond_key_lengths(call),
                             tile_traits(call))  # fmt: skip


def tile_traits(call: Call) -> _plan.TileTraits:
    """What the tile rules read of a call: its operands as the kernels get them (a padding mask as
    segment ids, mask_as_segments), its window and deterministic mode."""
    config = call.config
    return _plan.TileTraits(
        bias_or_mask=not _no_bias_or_2d_mask(call), softcap=bool(config.softcap),
        lengths=call.query_seq_lengths is not None or call.key_value_seq_lengths is not None,
        segments=call.q_segment_ids is not None or mask_runs_as_segments(call), window_left=config.window_left,
        window_right=config.window_right, deterministic=_ffi.deterministic())  # fmt: skip


def _pad_head_dim(x, size: int):
    pad = size - x.shape[-1]
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def mask_as_segments(call: Call) -> Call:
    """`call` with a boolean mask that varies along the keys alone ([B or 1, 1, 1, S], a padding
    mask) or the queries alone ([B or 1, 1, T, 1]) given to the kernels as segment ids: the queries
    in segment 0, the keys in 0 where attended and 1 where not (or the other way round). The same
    visibility, but the kernels skip the key blocks of no shared segment and read no mask per
    logit (a mask runs the bias kernels, whose backward takes only whole [T, S] rows on Hopper).
    Left as it is when the call has segment ids of its own."""
    mask, b, t, s = call.mask, call.query.shape[0], call.query.shape[1], call.key.shape[1]
    if not mask_runs_as_segments(call):
        return call
    # Segment 0 where the mask attends, 1 where it hides, one row a batch row.
    segments_of = lambda m, length: jnp.broadcast_to(jnp.where(m, 0, 1).astype(jnp.int32), (b, length))  # noqa: E731
    if mask.shape[2] == 1:  # along the keys (or neither)
        q_segments, kv_segments = jnp.zeros((b, t), jnp.int32), segments_of(mask[:, 0, 0, :], s)
    else:
        q_segments, kv_segments = segments_of(mask[:, 0, :, 0], t), jnp.zeros((b, s), jnp.int32)
    return dataclasses.replace(call, mask=None, q_segment_ids=q_segments, kv_segment_ids=kv_segments)


def mask_runs_as_segments(call: Call) -> bool:
    """Whether `mask_as_segments` turns the call's mask into segment ids (from shapes alone)."""
    mask = call.mask
    along_one_axis = mask is not None and mask.shape[1] == 1 and (mask.shape[2] == 1 or mask.shape[3] == 1)
    return along_one_axis and call.q_segment_ids is None


def _mask_arrays(call: Call) -> tuple:
    return call.query_seq_lengths, call.key_value_seq_lengths, call.q_segment_ids, call.kv_segment_ids


def _bias_arrays(call: Call) -> tuple:
    """The bias and mask operands of the kernels."""
    batch = call.query.shape[0]
    return _ffi.bias_operand(call.bias, batch, call.query.dtype), _ffi.mask_operand(call.mask, batch)


def _call_of_operands(config: AttentionConfig, q, k, v, bias, mask, masks) -> Call:
    """The call that the kernels' operands stand for (an empty bias or mask: none), for the xla
    path's formulas where no kernel runs."""
    return Call(q, k, v, bias if bias.size else None, mask if mask.size else None, *masks, config, True)


def _kernel_masks(q, k, q_len, kv_len, q_seg, kv_seg) -> KernelMasks:
    return kernel_masks(q.shape[0], q.shape[1], k.shape[1], q_len, kv_len, q_seg, kv_seg)


def attention(call: Call, strict: bool = False, sinks=None) -> tuple[jax.Array, jax.Array]:
    """(output [B, T, N, H], lse [B, T, N] float32) from the CUDA kernels, with `sinks` ([N] or
    None) in every row's softmax. Its gradient comes from the backward kernels, or where this GPU's
    shared memory is too small for them (`_plan.backward_kernels_fit`) from the xla path's
    backward; `strict` (implementation="cuda") raises a ValueError there instead."""
    plan = plan_of(call)
    head_dim, value_dim = plan.forward_dims
    call = mask_as_segments(call)
    q, k = _pad_head_dim(call.query, head_dim), _pad_head_dim(call.key, head_dim)
    v = _pad_head_dim(call.value, value_dim)
    bias, mask = _bias_arrays(call)
    sinks = _ffi.sinks_operand(sinks, q.shape[0])
    out, lse = _flash(call.config, strict, plan, q, k, v, bias, mask, *_mask_arrays(call), sinks)
    return out[..., : call.value.shape[-1]], lse.transpose(0, 2, 1)


def backward(call: Call, out, lse, d_out, d_lse) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) of a call from the kernels' backward, given an output and lse [B, T, N] that
    need not be this call's own: ring attention passes the final ones of the whole sequence."""
    if kernel_head_dim(_widest_head_dim(call), BWD_HEAD_DIMS) is None:  # above 256: no backward kernels
        return _xla_backward(call, out, lse, d_out, d_lse)[:3]
    call, family = mask_as_segments(call), _plan.family()
    padded = kernel_head_dim(_widest_head_dim(call), TURING_HEAD_DIMS if family is Family.TURING else FWD_HEAD_DIMS)
    q, k, v, out, d_out = (_pad_head_dim(x, padded) for x in (call.query, call.key, call.value, out, d_out))
    masks = _mask_arrays(call)
    backward = _plan.backward_plan(family, padded, padded, not _no_bias_or_2d_mask(call))
    tiles = _plan.backward_tiles(family, backward[0], tile_traits(call))
    plan = _plan.KernelPlan(family, (padded, padded), False, *backward, backward_tiles=tiles)
    dq, dk, dv, *_ = _gradients(call.config, False, plan, q, k, v, *_bias_arrays(call), False, out,
                               lse.transpose(0, 2, 1), masks, _kernel_masks(q, k, *masks), d_out,
                               d_lse.transpose(0, 2, 1))  # fmt: skip
    head_dim, value_dim = call.query.shape[-1], call.value.shape[-1]
    return dq[..., :head_dim], dk[..., :head_dim], dv[..., :value_dim]


def _xla_backward(call: Call, out, lse, d_out, d_lse):
    """The xla path's backward where no kernel's runs, in the largest blocks memory allows."""
    return xla_impl.backward(call, out, lse, d_out, d_lse, *dense_impl.backward_blocks(call))


def _forward(config: AttentionConfig, plan: _plan.KernelPlan, q, k, v, bias, mask, masks, sinks):
    """(out, lse [B, N, T], the kernels' mask operands), from the decode kernels where the plan
    says so (_decode.py), else the forward kernels; sinks [B, N] or [B, 0]."""
    kernel = _kernel_masks(q, k, *masks)
    if plan.decode:
        b, kv_len = q.shape[0], masks[1]
        kv_lengths = jnp.zeros((b, 0), jnp.int32) if kv_len is None else kv_len.astype(jnp.int32)[:, None]
        no_pages = jnp.zeros((b, 0), jnp.int32)
        return *_ffi.decode(config, q, k, v, kv_lengths, no_pages, sinks=sinks), kernel
    return *_ffi.forward(config, plan, q, k, v, kernel, bias, mask, sinks), kernel


SINKS = 9  # of _flash's arrays
DIFFERENTIABLE = (0, 1, 2, 3, SINKS)  # q, k, v, the bias and the sinks


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _flash(config: AttentionConfig, strict: bool, plan: _plan.KernelPlan, q, k, v, bias, mask, q_len, kv_len, q_seg,
           kv_seg, sinks):  # fmt: skip
    """(out, lse [B, N, T]: the kernels' layout, which the backward kernels read); sinks float32
    [B, N] (in the lse: the backward needs nothing more) or [B, 0]."""
    out, lse, _ = _forward(config, plan, q, k, v, bias, mask, (q_len, kv_len, q_seg, kv_seg), sinks)
    return out, lse


@_flash.defjvp
def _flash_jvp(config: AttentionConfig, strict: bool, plan: _plan.KernelPlan, primals, tangents):
    # Reverse mode transposes the tangent into the backward kernels (_transpose); forward mode
    # evaluates it by the xla path's formula (_tangent_by_xla).
    out, lse = _flash(config, strict, plan, *primals)
    layout = _tangent.layout_of(primals, DIFFERENTIABLE)
    d_out, d_lse = _TANGENT((config, strict, plan), layout, primals, out, lse, [tangents[i] for i in layout.differentiable])
    return (out, lse), (d_out, d_lse)


def _tangent_by_xla(static, primals, out, lse, tangents, all_key_blocks=False):
    config, strict, _ = static
    if strict:
        raise ValueError(
            "implementation='cuda' has no forward-mode kernels (jax.jvp, jax.jacfwd, jax.linearize): "
            "implementation=None computes the tangent by the xla path's formula beside the kernels' forward")
    q, k, v, bias, mask, *masks, sinks = primals
    call = _call_of_operands(config, q, k, v, bias, mask, masks)
    tq, tk, tv, tb, t_sinks = tangents
    d_out, d_lse = xla_impl.tangent(call, out, lse.transpose(0, 2, 1), (tq, tk, tv, tb if bias.size else None),
                                    *dense_impl.backward_blocks(call), all_key_blocks=all_key_blocks)  # fmt: skip
    d_lse = d_lse.transpose(0, 2, 1)
    if sinks.shape[1]:
        # The logits' part above is taken with the lse and output that hold the sink; the sink's
        # own logit adds P_sink d_sink to d lse and, through d lse, -P_sink d_sink O to d out.
        d_sink_term = _sink_weights(sinks, lse) * t_sinks[:, :, None]  # [B, N, T]
        d_lse = d_lse + d_sink_term
        d_out = (d_out - d_sink_term.transpose(0, 2, 1)[..., None] * out.astype(jnp.float32)).astype(d_out.dtype)
    return d_out, d_lse


def _sink_weights(sinks, lse):
    """P_sink = exp(sink - lse) [B, N, T] from sinks [B, N] and an lse [B, N, T] that holds them
    (0 where both are -inf)."""
    return jnp.where(lse > -jnp.inf, jnp.exp(sinks[:, :, None] - jnp.where(lse > -jnp.inf, lse, 0)), 0.0)


def _transpose(static, primals, out, lse, d_out, d_lse, needed):
    config, strict, plan = static
    q, k, v, bias, mask, *masks, sinks = primals
    *grads, dbias, delta = _gradients(config, strict, plan, q, k, v, bias, mask, needed[3], out, lse, masks,
                                      _kernel_masks(q, k, *masks), d_out, d_lse)  # fmt: skip
    return (*grads, dbias, _sinks_gradient(sinks, out, lse, d_out, d_lse, delta) if needed[4] else None)


def _sinks_gradient(sinks, out, lse, d_out, d_lse, delta):
    """d sinks [B, N] = -sum over the rows of P_sink delta, delta = rowsum(dO * O) - d lse (the
    backward kernels' own, or None: formed here): the sink's logit gets the softmax backward's
    dS = P (dP - delta) with dP = 0, as it carries no value."""
    if not sinks.shape[1]:
        return jnp.zeros_like(sinks)
    if delta is None:
        delta = jnp.zeros(lse.shape, jnp.float32)
        if d_out is not None:
            delta = jnp.einsum("btnh,btnh->bnt", d_out.astype(jnp.float32), out.astype(jnp.float32))
        if d_lse is not None:
            delta = delta - d_lse
    return -(_sink_weights(sinks, lse) * delta).sum(-1)


def _gradients(config: AttentionConfig, strict: bool, plan: _plan.KernelPlan, q, k, v, bias, mask, want_dbias: bool,
               out, lse, masks, kernel, d_out, d_lse):  # fmt: skip
    """(dq, dk, dv, dbias or None, delta or None) from the backward kernels (lse and d_lse
    [B, N, T]; delta [B, N, T] their rowsum(dO * O) - d_lse, None where the xla path's backward
    ran); a cotangent of None is zero: an lse the loss does not use (the usual case) passes an
    empty [B, N, 0] cotangent, which the kernels read as zero, so no zeros are written."""
    d_out = jnp.zeros(out.shape, out.dtype) if d_out is None else d_out
    b, t, n, _ = q.shape
    # A head dim without backward kernels takes the next one up, zero-padded: zero columns change
    # no logit and get zero gradients. A narrower V (from its own forward kernel: 192 / 128) has a
    # backward of its own too, or is padded to the query head dim's kernels.
    head_dim, dims = q.shape[-1], (q.shape[-1], k.shape[-1], v.shape[-1])
    padded, padded_value = plan.backward_dims or (None, None)
    if not plan.backward_fits:
        if strict and padded is None:
            raise ValueError(
                f"implementation='cuda' cannot differentiate this call: no backward kernels above head dim "
                f"{BWD_HEAD_DIMS[-1]} (got {head_dim}); implementation=None takes the xla path's backward there")
        if strict:
            raise ValueError(
                f"implementation='cuda' cannot differentiate this call: the backward kernels at head dim {padded} "
                f"need more shared memory a block than this GPU allows ({_ffi.smem_limit()} bytes); "
                "implementation=None takes the xla path's backward there")  # fmt: skip
        d_lse = jnp.zeros((b, t, n), jnp.float32) if d_lse is None else d_lse.transpose(0, 2, 1)
        call = _call_of_operands(config, q, k, v, bias, mask, masks)
        dq, dk, dv, dbias = _xla_backward(call, out, lse.transpose(0, 2, 1), d_out, d_lse)
        return dq, dk, dv, dbias if want_dbias else None, None
    d_lse = jnp.zeros((b, n, 0), jnp.float32) if d_lse is None else d_lse
    q, k = (_pad_head_dim(x, padded) for x in (q, k))
    v, out, d_out = (_pad_head_dim(x, padded_value) for x in (v, out, d_out))
    *grads, dbias, delta = _ffi.backward(config, plan, q, k, v, out, lse, d_out, d_lse, kernel, bias, mask,
                                         want_dbias)  # fmt: skip
    dbias = dbias.astype(bias.dtype) if want_dbias else None
    return tuple(g[..., :dim] for g, dim in zip(grads, dims, strict=True)) + (dbias, delta)


_TANGENT = _tangent.TangentMap("jax_flash_cuda_attention_tangent", _tangent_by_xla, _transpose,
                               functools.partial(_tangent_by_xla, all_key_blocks=True), symbolic_zeros=True)
