"""The compiled CUDA module: loading it, registering its XLA FFI handlers, and the ffi_calls.

The module `jax_flash._cuda` exists only when the package was built with a CUDA compiler. Its
`registrations()` returns `{target name: PyCapsule}`; each is registered for the CUDA platform the
first time a kernel is needed, so importing jax_flash never touches the GPU runtime.
"""

from __future__ import annotations

import functools
import importlib
import os

import jax
import jax.numpy as jnp
import numpy as np
from jaxlib import xla_client

from jax_flash import _batching, _contract, _decode, _env, _operands, _partition
from jax_flash._masks import KernelMasks


@functools.cache
def extension():
    """The compiled module, or None when the package was installed without CUDA."""
    try:
        return importlib.import_module("jax_flash._cuda")
    except ImportError:
        return None


PORTABLE_BUILT_ARCHS = ("75", "80", "90a", "80-virtual")  # CMakeLists.txt's JAX_FLASH_PORTABLE_ARCHS
# A module from before it named its targets was built for the default list of then.
UNNAMED_BUILT_ARCHS = ("80", "90a")


def built_archs() -> tuple[str, ...]:
    """The CUDA targets the extension was compiled for, e.g. ("80", "90a", "80-virtual")."""
    module = extension()
    listed = getattr(module, "built_archs", None)
    return tuple(listed.split(",")) if isinstance(listed, str) and listed else UNNAMED_BUILT_ARCHS


def _capability_of(digits: str) -> tuple[int, int]:
    """The compute capability a target's digits name: "86" -> (8, 6), "100" -> (10, 0)."""
    return int(digits[:-1]), int(digits[-1])


def has_machine_code(capability: tuple[int, int], archs: tuple[str, ...]) -> bool:
    """Whether code for one of `archs` runs on a GPU of `capability`: sm_XY machine code on X.Z for
    Z >= Y (the same major), sm_90a only on 9.0, and XY-virtual (PTX, which the driver compiles on
    first use) on every GPU from X.Y on."""
    for arch in archs:
        if arch.endswith("-virtual"):
            runs = capability >= _capability_of(arch.removesuffix("-virtual"))
        elif arch.endswith("a"):
            runs = capability == _capability_of(arch[:-1])
        else:
            major, minor = _capability_of(arch)
            runs = capability[0] == major and capability[1] >= minor
        if runs:
            return True
    return False


@functools.cache
def device_capability() -> tuple[int, int]:
    """(major, minor) compute capability of the default GPU, e.g. (9, 0) for an H100; (0, 0) where
    the device reports none (not a CUDA GPU)."""
    capability = getattr(jax.devices()[0], "compute_capability", None)
    if capability is None:
        return 0, 0
    major, minor = str(capability).split(".")[:2]
    return int(major), int(minor)


@functools.cache
def cuda_device_available() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices()) and jax.default_backend() == "gpu"
    except RuntimeError:
        return False


@functools.cache
def register_targets() -> tuple[str, ...]:
    """Register every handler of the extension with XLA; returns the target names."""
    module = extension()
    if module is None:
        return ()
    # Every handler launches the same kernels for the same shapes and attributes (no host work that
    # reads device data), so XLA may capture it into a CUDA graph: a decode step is launch-bound.
    # jax registers a handler with the traits it is given here (none by default).
    traits = xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
    names = []
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA", traits=traits)
        names.append(name)
    return tuple(names)


def _window_attrs(config) -> dict:
    """Scalar attributes as the handlers declare them (np.float32 / np.int32; -1 = unbounded,
    softcap 0 = none)."""
    unbounded = lambda w: np.int32(-1 if w is None else w)  # noqa: E731
    return dict(
        scale=np.float32(config.scale),
        softcap=np.float32(config.softcap or 0.0),
        window_left=unbounded(config.window_left),
        window_right=unbounded(config.window_right),
        diagonal_by_lengths=np.int32(config.diagonal_by_lengths),
    )


# The Turing family's targets in a module from before it named each family's: its own and Hopper's.
UNNAMED_TURING_ARCHS = ("75", "90a")


def family_archs() -> dict[str, tuple[str, ...]]:
    """The targets each kernel family was compiled for (CMakeLists.txt): "hopper", "turing",
    "mma_sync" and "mma_sync_off_hopper" (the mma.sync kernels a Hopper GPU runs only where a test
    forces that family, whose sm_90a code a test build alone has)."""
    listed = getattr(extension(), "family_archs", None)
    if isinstance(listed, str) and listed:
        return {name: tuple(archs.split(",")) for name, archs in (entry.split("=") for entry in listed.split())}
    built = built_archs()
    turing = tuple(a for a in built if a in UNNAMED_TURING_ARCHS)
    return {"hopper": built, "turing": turing, "mma_sync": built, "mma_sync_off_hopper": built}


# Shared memory a block may opt in to, by compute capability (the CUDA programming guide); other
# GPUs are taken as the smallest of those from 8.0 on. The Hopper kernels run on 9.0 alone; the
# mma.sync backward's usual tiles take 114-209 KB a block, more than sm_86 and sm_89 allow, its
# compact ones 65-145 KB.
SMEM_OPTIN_BY_CAPABILITY = {(7, 5): 65536, (8, 0): 166912, (8, 7): 166912, (8, 6): 101376, (8, 9): 101376,
                            (9, 0): 232448, (10, 0): 232448, (10, 3): 232448, (12, 0): 101376, (12, 1): 101376}
# A number of bytes: the limit the dispatch assumes instead of the GPU's (read when a call is
# traced). With JAX_FLASH_KERNELS=sm80 on an H100, 101376 runs the mma.sync kernels as an sm_86 or
# sm_89 GPU would take them.
SMEM_LIMIT_ENV = "JAX_FLASH_SMEM_LIMIT"


def forced_smem_limit() -> int:
    """JAX_FLASH_SMEM_LIMIT's bytes, or 0 where it is unset (the launchers then take the GPU's own
    limit)."""
    forced = os.environ.get(SMEM_LIMIT_ENV)
    if not forced:
        return 0
    if not forced.isdigit():
        raise ValueError(f"{SMEM_LIMIT_ENV} must be a number of bytes, got {forced!r}")
    return int(forced)


def smem_limit() -> int:
    """Bytes of shared memory a block may use on the default GPU, as the dispatch assumes."""
    fallback = min(limit for capability, limit in SMEM_OPTIN_BY_CAPABILITY.items() if capability >= (8, 0))
    return forced_smem_limit() or SMEM_OPTIN_BY_CAPABILITY.get(device_capability(), fallback)


# Bit-reproducible gradients (read when a call is traced): "1" makes the backward kernels add their
# dQ parts in a fixed order (key block after key block) instead of as they finish; a few percent
# slower. "0" (default) or unset: any order.
DETERMINISTIC_ENV = "JAX_FLASH_DETERMINISTIC"


def deterministic() -> bool:
    return _env.flag(DETERMINISTIC_ENV, default=False)


def call_kernel(target: str, result_types, operands, attrs: dict):
    """One custom call: its operands and result types as the target's named tuples
    (_operands.py, generated from the handlers' table), its attributes by name. (A module-level
    function, so that the CPU tests of the partitioning can put a pure-JAX stand-in for the
    kernels here.)"""
    attrs = checked_attrs(target, operands, result_types, attrs)
    return jax.ffi.ffi_call(target, tuple(result_types))(*operands, **attrs)


def checked_attrs(target: str, operands, result_types, attrs: dict) -> dict:
    """attrs, once the call is seen to match the handler's table: a missing or extra operand or
    attribute would otherwise reach the handler as a shifted buffer."""
    operand_type, result_type, names = _operands.TARGETS[target]
    if type(operands) is not operand_type or type(result_types) is not result_type or set(attrs) != set(names):
        raise TypeError(f"{target} takes {operand_type.__name__}, {result_type.__name__} and the attributes "
                        f"{names}; got {type(operands).__name__}, {type(result_types).__name__} and {tuple(attrs)}")
    return attrs


# _partition layouts of the KernelMasks operands: seqlens, q/kv segments, q/kv chunk summaries.
_MASK_LAYOUTS = ("b-", "b-", "b-", "b--", "b--")


def bias_operand(bias, batch: int, dtype):
    """The kernels' bias operand: float32 or the inputs' dtype, [B, 0, 0, 0] when absent."""
    if bias is None:
        return jnp.zeros((batch, 0, 0, 0), dtype)
    return bias if bias.dtype in (dtype, jnp.float32) else bias.astype(jnp.float32)


def mask_operand(mask, batch: int):
    return jnp.zeros((batch, 0, 0, 0), jnp.bool_) if mask is None else mask


def _bias_layout(x, batch: int, heads: int) -> str:
    """A bias, mask or dbias [B or 1, N or 1, T, S]: split along its batch and heads where full."""
    return ("b" if x.shape[0] == batch else "-") + ("n" if x.shape[1] == heads else "-") + "--"


def _dbias_shape(bias, q, k) -> tuple[int, ...]:
    """The kernels add d logit into dbias with atomics, so elements that a broadcast axis shares
    are summed in any order. For bit-reproducible gradients (deterministic mode) they write every
    [B, N, T, S] element once instead, and XLA sums the broadcast axes."""
    if not deterministic():
        return bias.shape
    return (q.shape[0], q.shape[2], q.shape[1], k.shape[1])


def _fwd_scratch_size(batch: int, seqlen_q: int, heads: int) -> int:
    """int32 elements of the sm90 forward's scratch (FwdScratch in cuda/common/params.h): its
    counters, then a flag and a list entry per tile of its smallest rows."""
    tiles = batch * heads * -(-seqlen_q // _contract.FWD_SCRATCH_TILE_ROWS)
    return _contract.FWD_SCRATCH_COUNTERS + 2 * tiles


def sinks_operand(sinks, batch: int):
    """The kernels' sinks operand from [N] or [B, N] sinks: float32 [B, N] (each batch row's, so
    that vmap and sharding split it with the rows and heads), or [B, 0] for none."""
    if sinks is None:
        return jnp.zeros((batch, 0), jnp.float32)
    return jnp.broadcast_to(sinks.astype(jnp.float32), (batch, sinks.shape[-1]))


def _sinks_layout(sinks) -> str:
    return "bn" if sinks.shape[1] else "b-"  # empty: no head axis to split


def forward(config, plan, q, k, v, masks: KernelMasks, bias, mask, sinks):
    """(out [B, T, N, Hv], lse [B, N, T] float32) from the forward kernel (Hv: v's head dim), given
    the operands of `bias_operand`, `mask_operand` and `sinks_operand` (its sinks in the lse and
    the output); under vmap, one call with the mapped axis folded into the batch or the heads
    (_batching.py)."""
    register_targets()
    attrs = dict(_window_attrs(config), family=np.int32(plan.family), tiles=np.int32(plan.forward_tiles))

    def run(q, k, v, bias, mask, sinks, *masks):
        def kernel(q, k, v, bias, mask, sinks, *masks):
            b, t, n, _ = q.shape
            result_types = _operands.FwdResults(
                o=jax.ShapeDtypeStruct((b, t, n, v.shape[-1]), q.dtype),
                lse=jax.ShapeDtypeStruct((b, n, t), jnp.float32),
                tile_scratch=jax.ShapeDtypeStruct((_fwd_scratch_size(b, t, n),), jnp.int32),
            )
            operands = _operands.FwdOperands(q, k, v, *masks, bias=bias, mask=mask, sinks=sinks)
            out, lse, _ = call_kernel("jax_flash_fwd", result_types, operands, attrs)
            return out, lse

        b, _, n, _ = q.shape
        layouts_in = ("b-n-", "b-k-", "b-k-", _bias_layout(bias, b, n), _bias_layout(mask, b, n),
                      _sinks_layout(sinks)) + _MASK_LAYOUTS  # fmt: skip
        run_split = _partition.over_batch_and_heads(kernel, layouts_in, ("b-n-", "bn-"), n, k.shape[2])
        return run_split(q, k, v, bias, mask, sinks, *masks)

    folded = _batching.fold_queries_into_heads(run, operands=("q", "k", "v", "bias", "mask", "sinks",
                                                              *KernelMasks._fields),
                                               broadcast=("bias", "mask"), per_head=("sinks",))  # fmt: skip
    return _partition.vary_like(folded(q, k, v, bias, mask, sinks, *masks), q, k, v)


def _scale_operands(key_scale, value_scale, rows: int, kv_heads: int):
    """The split-KV kernels' fp8 scale operands: each [K] scale as float32 [rows, K] (a row's own,
    so that vmap and the batch split fold them with the rows), or [rows, 0] without fp8."""
    if key_scale is None:
        return [jnp.zeros((rows, 0), jnp.float32)] * 2
    return [jnp.broadcast_to(s.astype(jnp.float32), (rows, kv_heads)) for s in (key_scale, value_scale)]


def decode(config, q, k, v, kv_lengths, page_table, key_scale=None, value_scale=None, sinks=None):
    """(out [B, T, N, H], lse [B, N, T] float32) from the split-KV decode kernels: k, v a dense
    cache [B, S, K, H], or with a page table [B, max_pages] (else [B, 0]) a pool of pages
    [P, page_size, K, H]; kv_lengths int32 [B, 1] (clamped into [0, S] by the kernels) or [B, 0].
    With an fp8 cache, key_scale and value_scale: float32 [K], each batch row's (as [B, K], so that
    vmap folds them with the rows). `sinks` ([N] or [B, N], or None) join in the combine (or the
    one split).
    Each (device's) call cuts its keys into `_decode.splits` splits. Under vmap, one call
    (_batching.fold_decode)."""
    register_targets()
    attrs = _window_attrs(config)
    paged = page_table.shape[1] > 0
    b, kv_heads = q.shape[0], k.shape[2]
    fp8 = key_scale is not None
    scales = _scale_operands(key_scale, value_scale, b, kv_heads)

    def run(q, k, v, kv_lengths, page_table, key_scale, value_scale, sinks):
        def kernel(q, k, v, kv_lengths, page_table, key_scale, value_scale, sinks):
            b, t, n, h = q.shape
            seqlen_k = k.shape[1] * page_table.shape[1] if paged else k.shape[1]
            splits = _decode.splits(b, t, n, k.shape[2], seqlen_k, h, paged=paged, kv_bytes=k.dtype.itemsize)
            scratch = (splits, b, t, n) if splits > 1 else (0,)
            result_types = _operands.DecodeResults(
                o=jax.ShapeDtypeStruct(q.shape, q.dtype),
                lse=jax.ShapeDtypeStruct((b, n, t), jnp.float32),
                o_partial=jax.ShapeDtypeStruct(scratch + (h,) if splits > 1 else scratch, jnp.float32),
                lse_partial=jax.ShapeDtypeStruct(scratch, jnp.float32),
            )
            operands = _operands.DecodeOperands(q, k, v, kv_lengths=kv_lengths, page_table=page_table,
                                                key_scale=key_scale, value_scale=value_scale, sinks=sinks)  # fmt: skip
            out, lse, *_ = call_kernel("jax_flash_decode", result_types, operands, dict(attrs, splits=np.int32(splits)))
            return out, lse

        cache = "--k-" if paged else "b-k-"  # a pool of pages belongs to no batch row
        scale = "bk" if fp8 else "b-"  # empty without fp8: no kv-head axis to split
        layouts_in = ("b-n-", cache, cache, "b-", "b-", scale, scale, _sinks_layout(sinks))
        run_split = _partition.over_batch_and_heads(kernel, layouts_in, ("b-n-", "bn-"), q.shape[2], k.shape[2])
        return run_split(q, k, v, kv_lengths, page_table, key_scale, value_scale, sinks)

    folded = _batching.fold_decode(run, paged)
    return _partition.vary_like(folded(q, k, v, kv_lengths, page_table, *scales, sinks_operand(sinks, b)), q, k, v)


def ragged(config, q, k, v, kv_lengths, page_table, work, prefill_work, key_scale=None, value_scale=None,
           sinks=None):  # fmt: skip
    """(out [Q, N, H], lse [N, Q] float32) of a ragged batch from the split-KV kernels over its work
    list and the forward kernels' tiles over its prefill list (_ragged_work.py; [0, FIELDS]: none,
    as with fp8 pools): q [Q, N, H], pools [P, page_size, K, H], kv_lengths int32 [S] (clamped
    by the kernels), page_table [S, max_pages]; with fp8 pools, key_scale and value_scale float32
    [K]; `sinks` [N] or None. Rows that no item covers are left as the kernels leave them (the
    caller masks them). The keys are cut into `_decode.splits_of_tiles` splits of the list's grid."""
    register_targets()
    q_rows, n, h = q.shape
    sequences, kv_heads = page_table.shape[0], k.shape[2]
    scales = _scale_operands(key_scale, value_scale, sequences, kv_heads)
    splits = _decode.splits_of_tiles(work.shape[0] * kv_heads, k.shape[1] * page_table.shape[1], h, paged=True,
                                     kv_bytes=k.dtype.itemsize)  # fmt: skip
    scratch = (splits, q_rows, n) if splits > 1 else (0,)
    result_types = _operands.RaggedResults(
        o=jax.ShapeDtypeStruct(q.shape, q.dtype),
        lse=jax.ShapeDtypeStruct((n, q_rows), jnp.float32),
        o_partial=jax.ShapeDtypeStruct(scratch + (h,) if splits > 1 else scratch, jnp.float32),
        lse_partial=jax.ShapeDtypeStruct(scratch, jnp.float32),
    )
    operands = _operands.RaggedOperands(q, k, v, kv_lengths=kv_lengths, page_table=page_table, work=work,
                                        prefill_work=prefill_work, key_scale=scales[0], value_scale=scales[1],
                                        sinks=sinks_operand(sinks, sequences))  # fmt: skip
    out, lse, *_ = call_kernel("jax_flash_ragged", result_types, operands,
                               dict(_window_attrs(config), splits=np.int32(splits)))  # fmt: skip
    return out, lse


def backward(config, plan, q, k, v, out, lse, d_out, d_lse, masks: KernelMasks, bias, mask, want_dbias: bool):
    """(dq, dk, dv, dbias, delta) from the backward kernels; lse and d_lse are [B, N, T] float32
    (d_lse may be [B, N, 0]: zero, the lse unused); bias and mask as `forward` takes them. dbias
    (with `want_dbias`) is float32 in the bias's shape, summed over its broadcast axes; else an
    empty array. delta [B, N, T] float32: rowsum(dO * O) - d_lse, the kernels' own (what d sinks
    is formed from). Under vmap, one call with the mapped axis folded into the batch."""
    register_targets()
    attrs = dict(_window_attrs(config), family=np.int32(plan.family), tiles=np.int32(plan.backward_tiles),
                 deterministic=np.int32(deterministic()),
                 smem_limit=np.int32(forced_smem_limit()))

    def run(q, k, v, out, lse, d_out, d_lse, bias, mask, *masks):
        def kernel(q, k, v, out, lse, d_out, d_lse, bias, mask, *masks):
            b, t, n, _ = q.shape
            # Per-row statistics scratch, rows padded to whole query blocks (cuda/common/params.h).
            padded_t = -(-t // _contract.STATS_ROW_MULTIPLE) * _contract.STATS_ROW_MULTIPLE
            stats = jax.ShapeDtypeStruct((b, n, padded_t), jnp.float32)
            result_types = _operands.BwdResults(
                dq=jax.ShapeDtypeStruct(q.shape, q.dtype),
                dk=jax.ShapeDtypeStruct(k.shape, k.dtype),
                dv=jax.ShapeDtypeStruct(v.shape, v.dtype),
                dq_accum=jax.ShapeDtypeStruct((b, padded_t, n, q.shape[3]), jnp.float32),
                delta=stats,  # rowsum(dO * O) - dlse
                lse_log2=stats,
                dq_turns=jax.ShapeDtypeStruct((b, n, padded_t // _contract.DQ_COUNTER_ROWS), jnp.int32),
                dbias=jax.ShapeDtypeStruct(_dbias_shape(bias, q, k) if want_dbias else (b, 0, 0, 0), jnp.float32),
            )
            operands = _operands.BwdOperands(q, k, v, out, lse, d_out, d_lse, *masks, bias=bias, mask=mask)
            dq, dk, dv, _, delta, *_scratch, dbias = call_kernel("jax_flash_bwd", result_types, operands, attrs)
            broadcast_axes = tuple(i for i in range(4) if dbias.shape[i] != bias.shape[i])
            dbias = dbias.sum(broadcast_axes, keepdims=True) if broadcast_axes else dbias
            return dq, dk, dv, dbias, delta[:, :, :t]

        b, _, n, _ = q.shape
        bias_layout = _bias_layout(bias, b, n)
        layouts_in = ("b-n-", "b-k-", "b-k-", "b-n-", "bn-", "b-n-", "bn-", bias_layout, _bias_layout(mask, b, n))
        layouts_out = ("b-n-", "b-k-", "b-k-", bias_layout if want_dbias else "b---", "bn-")
        grads = _partition.over_batch_and_heads(kernel, layouts_in + _MASK_LAYOUTS, layouts_out, n, k.shape[2])
        return grads(q, k, v, out, lse, d_out, d_lse, bias, mask, *masks)

    operands = ("q", "k", "v", "out", "lse", "d_out", "d_lse", "bias", "mask", *KernelMasks._fields)
    fold = _batching.fold_into_batch(run, operands=operands, results=("dq", "dk", "dv", "dbias", "delta"),
                                     broadcast=("bias", "mask"), summed={"dbias": "bias"} if want_dbias else None)
    grads = fold(q, k, v, out, lse.astype(jnp.float32), d_out, d_lse.astype(jnp.float32), bias, mask, *masks)
    return _partition.vary_like(grads, q, k, v, out, d_out)
