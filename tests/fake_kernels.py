"""A pure-JAX stand-in for the custom calls, for the CPU tests of what surrounds them.

`call_kernel` has the signature of `jax_flash._ffi.call_kernel` and returns what the kernels
return, computed by the xla path from the same operands and attributes. Put in its place (with
the CUDA checks faked), `implementation="cuda"` runs its real Python on CPU: batching, padding,
mask operands and the partitioning of the calls over sharded inputs.
"""

import types

import jax.numpy as jnp

from jax_flash import _contract, _ffi, _plan, _ragged_work, _sinks, paged, ragged, xla_impl
from jax_flash._validation import AttentionConfig, Call


def _call(attrs: dict, q, k, v, seqlens, q_segments, kv_segments, bias, mask) -> Call:
    bound = lambda w: None if int(w) < 0 else int(w)  # noqa: E731
    config = AttentionConfig(float(attrs["scale"]), bound(attrs["window_left"]), bound(attrs["window_right"]),
                             float(attrs["softcap"]) or None, bool(attrs["diagonal_by_lengths"]))  # fmt: skip
    lengths = (seqlens[:, 0], seqlens[:, 1]) if seqlens.shape[1] else (None, None)
    segments = (q_segments, kv_segments) if q_segments.shape[1] else (None, None)
    present = lambda x: x if x.size else None  # noqa: E731
    return Call(q, k, v, present(bias), present(mask), *lengths, *segments, config, True)


def _dbias_result(dbias, result_type):
    """The kernels' dbias: in the bias's shape, or (deterministic mode) [B, N, T, S] for XLA to
    sum; the stand-in puts each sum at index 0 of the broadcast axes."""
    if dbias is None or 0 in result_type.shape:  # no bias, or its gradient not wanted
        return jnp.zeros(result_type.shape, result_type.dtype)
    pads = [(0, full - n) for full, n in zip(result_type.shape, dbias.shape)]
    return jnp.pad(dbias.astype(jnp.float32), pads)


def _with_sinks(out, lse, sinks):
    """The kernels' sinks operand ([B, N], or [B, 0]: none) joined to (out, lse [B, T, N])."""
    return (out, lse) if sinks.shape[1] == 0 else _sinks.apply(out, lse, sinks[:, None, :])


def launchers_take(target: str, operands, attrs: dict) -> bool:
    """Whether the launchers (run_sm90.cuh, run_sm80.cuh, dispatch.cu) run the call's `tiles`:
    each shape beyond USUAL at the family, head dims and variant that have it, else refused."""
    tiles, family = _plan.Tiles(int(attrs["tiles"])), _plan.Family(int(attrs["family"]))
    h, hv = operands.q.shape[-1], operands.v.shape[-1]
    bias = operands.bias.size > 0 or operands.mask.size > 0
    softcap, segments = float(attrs["softcap"]) > 0, operands.q_segments.shape[1] > 0
    plain = not (bias or softcap or segments or operands.seqlens.shape[1])
    forward, hopper = target == "jax_flash_fwd", family is _plan.Family.HOPPER
    if tiles is _plan.Tiles.USUAL:
        return True
    if tiles is _plan.Tiles.TALL:
        return forward and hopper and h == hv == 64 and not (bias or softcap)
    if tiles is _plan.Tiles.WIDE_KEYS:
        return forward and hopper and h == hv and h in (128, 256) and not bias
    if tiles is _plan.Tiles.STEPS_OF_80:
        unbanded = int(attrs["window_left"]) < 0 and int(attrs["window_right"]) < 0
        return not forward and hopper and h == hv == 128 and plain and unbanded and not int(attrs["deterministic"])
    hopper_has = h in _contract.BWD_SM90_HEAD_DIMS + _contract.BWD_SM90_NO_BIAS_HEAD_DIMS or h != hv
    return not forward and family is not _plan.Family.TURING and not (hopper and hopper_has)  # COMPACT


def call_kernel(target: str, result_types, operands, attrs: dict):
    attrs = _ffi.checked_attrs(target, operands, result_types, attrs)  # as the real call checks them
    if target not in ("jax_flash_decode", "jax_flash_ragged") and not launchers_take(target, operands, attrs):
        raise ValueError(f"{target}: the launchers refuse tiles {attrs['tiles']} for this call")
    if target == "jax_flash_fwd":
        x = operands
        call = _call(attrs, x.q, x.k, x.v, x.seqlens, x.q_segments, x.kv_segments, x.bias, x.mask)
        out, lse = _with_sinks(*xla_impl.attention(call), x.sinks)
        return out, lse.transpose(0, 2, 1), _zeros(result_types.tile_scratch)
    if target == "jax_flash_decode":
        q, k, v, kv_lengths, page_table, key_scale, value_scale, sinks = operands
        if page_table.shape[1]:  # a pool of pages: the sequences' caches gathered from it
            k, v = paged.gather_pages(k, page_table), paged.gather_pages(v, page_table)
        out_dtype = q.dtype
        if key_scale.shape[1]:  # an fp8 cache: its values exactly (the kernels fold the scales into float32 products)
            q = q.astype(jnp.float32)
            k, v = (x.astype(jnp.float32) * s[:, None, :, None] for x, s in ((k, key_scale), (v, value_scale)))
        b, t, s = q.shape[0], q.shape[1], k.shape[1]
        empty = jnp.zeros((b, 0), jnp.int32)
        seqlens = empty
        if kv_lengths.shape[1]:  # clamped into the cache, as the kernels do
            seqlens = jnp.stack([jnp.full((b,), t, jnp.int32), jnp.clip(kv_lengths[:, 0], 0, s)], -1)
        out, lse = _with_sinks(*xla_impl.attention(_call(attrs, q, k, v, seqlens, empty, empty, empty, empty)), sinks)
        return (out.astype(out_dtype), lse.astype(jnp.float32).transpose(0, 2, 1), _zeros(result_types.o_partial),
                _zeros(result_types.lse_partial))  # fmt: skip
    if target == "jax_flash_ragged":
        return _ragged(result_types, operands, attrs)
    x, r = operands, result_types
    call = _call(attrs, x.q, x.k, x.v, x.seqlens, x.q_segments, x.kv_segments, x.bias, x.mask)
    d_lse = jnp.zeros(x.lse.shape, x.lse.dtype) if x.dlse.size == 0 else x.dlse  # empty: the lse unused
    dq, dk, dv, dbias = xla_impl.backward(call, x.o, x.lse.transpose(0, 2, 1), x.dout, d_lse.transpose(0, 2, 1))
    # delta as the kernels leave it: rowsum(dO * O) - d lse, 0 past T
    delta = jnp.einsum("btnh,btnh->bnt", x.dout.astype(jnp.float32), x.o.astype(jnp.float32)) - d_lse
    delta = jnp.pad(delta, [(0, 0), (0, 0), (0, r.delta.shape[2] - delta.shape[2])])
    scratch = [_zeros(t) for t in (r.lse_log2, r.dq_turns)]
    return (dq.astype(r.dq.dtype), dk, dv, _zeros(r.dq_accum), delta, *scratch, _dbias_result(dbias, r.dbias))


def _ragged(result_types, x, attrs: dict):
    """The ragged kernels from their operands: each row as its work lists cover it (a row that no
    item covers is left NaN, as the kernels leave it unwritten), the scales and sinks of sequence
    0 (the Python layer broadcasts one set to every sequence). Prefill items over fp8 pages are
    refused, as the handler refuses them."""
    q_rows, n, _ = x.q.shape
    if x.prefill_work.shape[0] and x.k.dtype != x.q.dtype:
        raise ValueError("jax_flash: ragged attention's prefill items take 16-bit pages")
    row_seq, row_query, row_count = _ragged_work.rows_of(x.work, q_rows, n // x.k.shape[2], x.prefill_work)
    left, softcap = int(attrs["window_left"]), float(attrs["softcap"])
    scales = (x.key_scale[0], x.value_scale[0]) if x.key_scale.shape[1] else (None, None)
    out, lse = ragged._walk(x.q, x.k, x.v, jnp.clip(x.kv_lengths, 0, x.k.shape[1] * x.page_table.shape[1]),
                            x.page_table, row_seq, row_query, row_count, *scales,
                            x.sinks[0] if x.sinks.shape[1] else None, scale=float(attrs["scale"]),
                            left=None if left < 0 else left, softcap=softcap or None)  # fmt: skip
    covered = row_seq >= 0
    out = jnp.where(covered[:, None, None], out, jnp.nan).astype(x.q.dtype)
    lse = jnp.where(covered[:, None], lse, jnp.nan).astype(jnp.float32).T
    return out, lse, _zeros(result_types.o_partial), _zeros(result_types.lse_partial)


def _zeros(result_type):
    return jnp.zeros(result_type.shape, result_type.dtype)


# What a portable build with the test families (JAX_FLASH_TEST_FAMILIES=ON, as the GPU tests run)
# reports of each family's targets (CMakeLists.txt).
TEST_BUILD_FAMILY_ARCHS = {"hopper": ("90a",), "turing": ("75", "90a"), "mma_sync": ("80", "90a", "80-virtual"),
                           "mma_sync_off_hopper": ("80", "90a", "80-virtual")}  # fmt: skip


def install(monkeypatch):
    """Make `implementation="cuda"` run on CPU through `call_kernel`."""
    # What the dispatch asks of the module: shared memory of the mma.sync backward and of its
    # forward above 256 (0: they fit every GPU; tests of the limit put their own sizes here), and
    # the targets built (the portable list, with the test families).
    module = types.SimpleNamespace(sm80_backward_smem_bytes=lambda head_dim: 0,
                                   sm80_backward_usual_smem_bytes=lambda head_dim: 0,
                                   sm80_wide_forward_smem_bytes=lambda head_dim: 0,
                                   sm75_backward_smem_bytes=lambda head_dim: 0,
                                   built_archs=",".join(_ffi.PORTABLE_BUILT_ARCHS),
                                   family_archs=" ".join(f"{family}={','.join(archs)}"
                                                         for family, archs in TEST_BUILD_FAMILY_ARCHS.items()))
    monkeypatch.setattr(_ffi, "extension", lambda: module)
    monkeypatch.setattr(_ffi, "cuda_device_available", lambda: True)
    monkeypatch.setattr(_ffi, "device_capability", lambda: (9, 0))
    monkeypatch.setattr(_ffi, "register_targets", lambda: ())
    monkeypatch.setattr(_ffi, "call_kernel", call_kernel)


class Calls(list):
    """(target, operand shapes) of every kernel call traced; `results[target]` and `attrs[target]`:
    the result shapes and attributes of its last call."""

    def __init__(self):
        super().__init__()
        self.results = {}
        self.attrs = {}


def record_calls(monkeypatch) -> Calls:
    """The stand-in installed (`install`), each call recorded in the list returned."""
    install(monkeypatch)
    calls = Calls()

    def recording(target, result_types, operands, attrs):
        calls.append((target, [x.shape for x in operands]))
        calls.results[target] = [r.shape for r in result_types]
        calls.attrs[target] = dict(attrs)
        return call_kernel(target, result_types, operands, attrs)

    monkeypatch.setattr(_ffi, "call_kernel", recording)
    return calls
