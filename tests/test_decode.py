"""The decode path's rule and plumbing on CPU: which calls the split-KV decode kernels take
(jax_flash/_decode.py), how many splits they get, and, through the pure-JAX stand-in for the
custom calls (tests/fake_kernels.py), that `jax_flash.attention` and `paged_attention` route
those calls to the decode target with the right operands (dense caches, pools of pages, vmap,
gradients) and give what the xla path gives. What the kernels compute is tested on GPUs
(test_cuda_decode.py)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from jax_flash import _decode, _ffi
from tests import fake_kernels, reference
from tests.cases import qkv, rng_for
from tests.test_paged import paged_problem
from tests.test_sharding import _collectives, _mesh


@pytest.fixture
def targets(monkeypatch):
    """The custom-call targets traced (through the stand-in), in order."""
    fake_kernels.install(monkeypatch)
    monkeypatch.setattr(_decode, "sm_count", lambda: 132)
    called = []

    def recording(target, result_types, operands, attrs):
        called.append((target, [x.shape for x in operands], [r.shape for r in result_types], attrs))
        return fake_kernels.call_kernel(target, result_types, operands, attrs)

    monkeypatch.setattr(_ffi, "call_kernel", recording)
    return called


@pytest.mark.parametrize("batch,kv_heads,cache,expected", [
    (64, 8, 4096, 1),     # 512 tiles fill 132 SMs: no split
    (8, 8, 32768, 1),     # 64 tiles on 64 SMs stream near HBM speed: no split (2 ran slower)
    (4, 12, 8192, 5),     # 48 tiles, too few to stream alone; one wave is 2 splits, 73% full, so
                          # the fewest splits within 85% of the best: 5, 240 CTAs, 91% of 2 waves
    (1, 8, 131072, 16),   # 8 tiles: 16 splits fill one wave (128 CTAs; 15 ran 3.5% slower)
    (4, 8, 8192, 4),      # 32 tiles: 4 splits fill one wave
    (4, 4, 8192, 8),      # 16 tiles: 8 splits fill one wave
    (1, 8, 64, 1),        # 4 blocks of 16 keys, 4 warps: one split
])  # fmt: skip
def test_split_rule(batch, kv_heads, cache, expected, monkeypatch):
    monkeypatch.setattr(_decode, "sm_count", lambda: 132)
    splits = _decode.splits(batch, 1, 4 * kv_heads, kv_heads, cache, 128)
    assert splits == expected
    tiles = batch * kv_heads
    assert 1 <= splits <= _decode.MAX_SPLITS and (splits == 1 or tiles * splits <= 2 * 132)


def test_split_rule_of_a_paged_cache(monkeypatch):
    # 64 tiles: one split for a dense cache, two (128 CTAs, hiding the page lookups) for a paged one
    monkeypatch.setattr(_decode, "sm_count", lambda: 132)
    assert _decode.splits(8, 1, 32, 8, 32768, 128) == 1
    assert _decode.splits(8, 1, 32, 8, 32768, 128, paged=True) == 2
    assert _decode.splits(64, 1, 32, 8, 4096, 128, paged=True) == 1


def test_split_rule_of_an_fp8_cache(monkeypatch):
    # A CTA streams elements at the 16-bit rate, half the bytes: 64 tiles of one split would read
    # an fp8 cache at 41% of an H100's HBM, so they take two (128 CTAs); 512 tiles still fill it.
    monkeypatch.setattr(_decode, "sm_count", lambda: 132)
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")])
    assert _decode.splits(8, 1, 32, 8, 32768, 128) == 1
    assert _decode.splits(8, 1, 32, 8, 32768, 128, kv_bytes=1) == 2
    assert _decode.splits(64, 1, 32, 8, 4096, 128, kv_bytes=1) == 1
    assert _decode.one_split_tiles(False, kv_bytes=1) == pytest.approx(2 * _decode.one_split_tiles(False))


@pytest.mark.parametrize("kind,expected", [("NVIDIA H100 80GB HBM3", 1), ("NVIDIA H200", 2), ("NVIDIA H100 PCIe", 1)])
def test_one_split_needs_the_tiles_to_stream_the_hbms_peak(kind, expected, monkeypatch):
    # 64 tiles of one split stream 3.0 TB/s: near an H100's peak, 65% of an H200's (decode D10)
    monkeypatch.setattr(_decode, "sm_count", lambda: 132)
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(device_kind=kind)])
    assert _decode.splits(8, 1, 32, 8, 32768, 128) == expected
    assert _decode.splits(64, 1, 32, 8, 4096, 128) == 1  # 512 tiles fill the GPU
    assert _decode.one_split_tiles(paged=False) <= _decode.one_split_tiles(paged=True) <= 132


def test_split_rule_forced_and_bounded(monkeypatch):
    monkeypatch.setenv(_decode.SPLITS_ENV, "7")
    assert _decode.splits(1, 1, 8, 8, 1 << 20, 64) == 7
    monkeypatch.setenv(_decode.SPLITS_ENV, "1000")
    assert _decode.splits(1, 1, 8, 8, 1 << 20, 64) == _decode.MAX_SPLITS


@pytest.mark.parametrize("t,n,kv_heads,masks,expected", [
    (1, 32, 8, False, True),
    (16, 64, 1, False, True),    # 1024 packed rows of one kv head: 64 tiles
    (17, 8, 8, False, False),    # past MAX_QUERIES: the forward kernels
    (1, 8, 8, True, False),      # query lengths, a bias, mask or segment ids
])  # fmt: skip
def test_which_calls_the_decode_kernels_take(t, n, kv_heads, masks, expected):
    assert _decode.takes(2, t, n, kv_heads, masks_beyond_key_lengths=masks) == expected


def test_decode_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(_decode.DECODE_ENV, "0")
    assert not _decode.takes(2, 1, 8, 8, masks_beyond_key_lengths=False)
    monkeypatch.setenv(_decode.DECODE_ENV, "yes")
    with pytest.raises(ValueError, match=_decode.DECODE_ENV):
        _decode.enabled()


def _decode_problem(rng, b=3, t=2, n=8, kv_heads=2, s=70, h=64):
    q, k, v = qkv(rng, jnp.bfloat16, b, t, s, n, kv_heads, h)
    lengths = jnp.asarray(rng.integers(t, s + 1, size=b), jnp.int32)
    return q, k, v, lengths


@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(local_window_size=(9, 0)), dict(softcap=4.0, is_causal=True)],
                         ids=["causal", "window", "softcap"])  # fmt: skip
def test_attention_takes_the_decode_target(targets, kw):
    q, k, v, lengths = _decode_problem(rng_for("decode-route", tuple(kw)))
    out, lse = jax_flash.attention(q, k, v, key_value_seq_lengths=lengths, implementation="cuda",
                                   return_residual=True, **kw)  # fmt: skip
    assert [c[0] for c in targets] == ["jax_flash_decode"]
    _, operand_shapes, result_shapes, attrs = targets[0]
    assert operand_shapes == [q.shape, k.shape, v.shape, (3, 1), (3, 0), (3, 0), (3, 0), (3, 0)]  # no pages, fp8 scales or sinks
    splits = int(attrs["splits"])
    assert result_shapes[2] == ((splits, 3, 2, 8, 64) if splits > 1 else (0,))
    ref_out, ref_lse = reference.attention(q, k, v, key_value_seq_lengths=lengths, **kw)
    assert reference.rel_error(out, ref_out) < 1e-2 and reference.rel_error(lse, ref_lse) < 1e-4


def test_longer_queries_and_biases_take_the_forward_target(targets):
    q, k, v, lengths = _decode_problem(rng_for("decode-not"), t=17)
    jax_flash.attention(q, k, v, key_value_seq_lengths=lengths, implementation="cuda")
    q, k, v, lengths = _decode_problem(rng_for("decode-bias"))
    jax_flash.attention(q, k, v, jnp.zeros((1, 8, 2, 70)), implementation="cuda")
    assert [c[0] for c in targets] == ["jax_flash_fwd", "jax_flash_fwd"]


def test_gradients_of_a_decode_call_come_from_the_backward(targets):
    q, k, v, lengths = _decode_problem(rng_for("decode-grad"))

    def loss(implementation, q, k, v):
        out = jax_flash.attention(q, k, v, key_value_seq_lengths=lengths, is_causal=True,
                                  implementation=implementation)  # fmt: skip
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size).reshape(out.shape)))

    grads = jax.grad(loss, argnums=(1, 2, 3))("cuda", q, k, v)
    assert [c[0] for c in targets] == ["jax_flash_decode", "jax_flash_bwd"]
    expected = jax.grad(loss, argnums=(1, 2, 3))("xla", q, k, v)
    for g, e in zip(grads, expected):
        assert reference.rel_error(g, e) < 2e-2


def test_vmap_over_the_queries_folds_them_into_heads(targets):
    q, k, v, lengths = _decode_problem(rng_for("decode-vmap"), t=1)
    qs = jnp.stack([q, q * 0.5, -q])
    fn = lambda q: jax_flash.attention(q, k, v, key_value_seq_lengths=lengths, is_causal=True, implementation="cuda")  # noqa: E731
    out = jax.vmap(fn)(qs)
    assert [c[0] for c in targets][-1] == "jax_flash_decode" and targets[-1][1][0] == (3, 1, 24, 64)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(out[i], np.float32), np.asarray(fn(qs[i]), np.float32), atol=2e-2)


def test_paged_attention_reads_the_pool_in_place(targets):
    rng = rng_for("decode-paged")
    q, kp, vp, lens, table, dense_k, dense_v = paged_problem(rng, 3, 2, 8, 2, 64, 32, 4, [100, 1, 64])
    out = jax_flash.paged_attention(q, kp, vp, lens, table, is_causal=True, implementation="cuda")
    assert [c[0] for c in targets] == ["jax_flash_decode"]
    assert targets[0][1] == [q.shape, kp.shape, vp.shape, (3, 1), table.shape, (3, 0), (3, 0), (3, 0)]  # no fp8 scales or sinks
    ref, _ = reference.attention(q, dense_k, dense_v, key_value_seq_lengths=lens, query_seq_lengths=jnp.full((3,), 2),
                                 is_causal=True)  # fmt: skip
    assert reference.rel_error(out, ref) < 1e-2


def test_paged_attention_gathers_where_the_kernels_cannot_read_in_place(targets):
    rng = rng_for("decode-paged-gather")
    q, kp, vp, lens, table, _, _ = paged_problem(rng, 2, 2, 4, 2, 32, 24, 3, [50, 7])  # pages of 24 tokens
    jax_flash.paged_attention(q, kp, vp, lens, table, is_causal=True, implementation="cuda")
    q, kp, vp, lens, table, _, _ = paged_problem(rng, 2, 20, 4, 2, 32, 16, 3, [40, 30])  # 20 queries
    jax_flash.paged_attention(q, kp, vp, lens, table, is_causal=True, implementation="cuda")
    # The gathered cache is dense: the decode kernels take the first call, the forward ones the second.
    assert [(c[0], c[1][1], c[1][4] if c[0] == "jax_flash_decode" else None) for c in targets] == [
        ("jax_flash_decode", (2, 72, 2, 32), (2, 0)), ("jax_flash_fwd", (2, 48, 2, 32), None)]


def test_vmap_over_pools(targets):
    """Each element's own pool and page table: the pools fold into one, each table moved to its
    element's pages (and clamped into them first, as without vmap)."""
    rng = rng_for("decode-paged-vmap")
    problems = [paged_problem(rng, 2, 1, 4, 2, 32, 16, 3, [40, 9]) for _ in range(3)]
    q, kp, vp, lens, table = (jnp.stack([p[i] for p in problems]) for i in range(5))
    table = table.at[1, 0, 0].set(10**6)  # outside the pool: clamped into element 1's own pool
    fn = lambda q, kp, vp, lens, table: jax_flash.paged_attention(q, kp, vp, lens, table, is_causal=True,  # noqa: E731
                                                                 implementation="cuda")
    out = jax.vmap(fn)(q, kp, vp, lens, table)
    assert targets[-1][1][1][0] == 3 * kp.shape[1]
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(out[i], np.float32),
                                      np.asarray(fn(q[i], kp[i], vp[i], lens[i], table[i]), np.float32))


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_sharded_decode_calls_are_partitioned(targets, axis_type):
    """A decode step on a cache split over batch and kv heads (2 x 4 host devices), dense and
    paged (the pool split over kv heads, the page table over the batch): each device runs the
    decode target on its own rows and heads, with no collective, and the values are those of the
    unsharded call."""
    mesh = _mesh(axis_type)
    spec, by_batch = P("data", None, "model", None), P("data")
    rng = rng_for("decode-sharded", str(axis_type))
    q, kp, vp, lens, table, dense_k, dense_v = paged_problem(rng, 4, 2, 16, 4, 32, 16, 3, [40, 9, 33, 1])
    dense = lambda q, k, v, lens: jax_flash.attention(  # noqa: E731
        q, k, v, key_value_seq_lengths=lens, is_causal=True, implementation="cuda")
    paged = lambda q, kp, vp, lens, table: jax_flash.paged_attention(  # noqa: E731
        q, kp, vp, lens, table, is_causal=True, implementation="cuda")
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    pool_spec = P(None, None, "model", None)
    for fn, args, specs in ((dense, (q, dense_k, dense_v, lens), (spec, spec, spec, by_batch)),
                            (paged, (q, kp, vp, lens, table), (spec, pool_spec, pool_spec, by_batch, by_batch))):
        placed = [put(x, s) for x, s in zip(args, specs)]
        assert not _collectives(jax.jit(fn), *placed)
        out = jax.jit(fn)(*placed)
        assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), out.ndim)
        assert reference.rel_error(out, jax.jit(fn)(*args)) < 1e-2  # the stand-in's blocks follow the shard shapes
    assert {t[0] for t in targets} == {"jax_flash_decode"}


def test_auto_mode_takes_the_decode_kernels(targets):
    """implementation=None on a (faked) GPU: a decode step goes to the decode target."""
    q, k, v, lengths = _decode_problem(rng_for("decode-auto"), t=1)
    jax_flash.attention(q, k, v, key_value_seq_lengths=lengths, is_causal=True)
    assert [c[0] for c in targets] == ["jax_flash_decode"]
