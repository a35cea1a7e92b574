"""jax_flash.attention under jit with inputs sharded over batch and heads (8 host devices, see
conftest.py): every device computes its own shard, forward and backward, with no collective in
the compiled program, and the values are those of the unsharded call. The CUDA path's custom
calls are tested on CPU with a pure-JAX stand-in for the kernels (tests/fake_kernels.py), and
with the kernels on 2 or more GPUs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from jax_flash import _partition
from jax_flash._partition import shard_map
from tests import fake_kernels, reference
from tests.cases import qkv, rng_for


COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "collective-permute", "reduce-scatter")


def _mesh(axis_type):
    devices = jax.devices("cpu")
    if len(devices) < 8:
        pytest.fail("conftest.py asks for 8 host devices; XLA_FLAGS was overridden")
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2, devices=devices[:8])


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("spec", [P("data", None, "model", None), P(None, None, "model", None), P("data")],
                         ids=["batch-and-heads", "heads", "batch"])  # fmt: skip
def test_sharded_call_has_no_collectives(axis_type, spec):
    mesh = _mesh(axis_type)
    q, k, v = qkv(rng_for("sharding", str(spec)), jnp.float32, 4, 96, 80, 8, 4, 16)  # GQA, T != S
    sharding = NamedSharding(mesh, spec)
    placed = [jax.device_put(x, sharding) for x in (q, k, v)]

    def attn(q, k, v):
        return jax_flash.attention(q, k, v, is_causal=True, implementation="xla")

    def loss(q, k, v):
        return jnp.sum(attn(q, k, v) ** 2)

    fwd, grad = jax.jit(attn), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    for fn in (fwd, grad):
        hlo = fn.lower(*placed).compile().as_text()
        found = [c for c in COLLECTIVES if c in hlo]
        assert not found, f"collectives in the sharded program: {found}"

    out = fwd(*placed)
    assert out.sharding.is_equivalent_to(sharding, out.ndim)
    np.testing.assert_allclose(out, attn(q, k, v), rtol=1e-5, atol=1e-6)
    for mine, ref in zip(grad(*placed), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)):
        assert mine.sharding.is_equivalent_to(sharding, mine.ndim)
        np.testing.assert_allclose(mine, ref, rtol=1e-4, atol=1e-5)


def test_attention_inside_shard_map():
    """Called per device inside shard_map (as ring attention and hand-sharded models do), the xla
    path's loop carries must carry the varying mesh axes of their inputs."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices("cpu")[:8])
    q, k, v = qkv(rng_for("shard_map"), jnp.float32, 8, 40, 40, 4, 2, 16)
    spec = P("data")
    attn = lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True, implementation="xla")  # noqa: E731
    per_device = shard_map(attn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    np.testing.assert_allclose(jax.jit(per_device)(q, k, v), attn(q, k, v), rtol=1e-5, atol=1e-6)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) ** 2)  # noqa: E731
    for mine, ref in zip(jax.jit(jax.grad(loss(per_device), argnums=(0, 1, 2)))(q, k, v),
                         jax.grad(loss(attn), argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(mine, ref, rtol=1e-4, atol=1e-5)


def _collectives(fn, *args) -> list[str]:
    hlo = fn.lower(*args).compile().as_text()
    return [c for c in COLLECTIVES if c in hlo]


MASKS = {
    "causal": lambda b, t: {"is_causal": True},
    "lengths_segments": lambda b, t: {
        "query_seq_lengths": jnp.arange(t, t - b, -1, dtype=jnp.int32),
        "key_value_seq_lengths": jnp.full((b,), t - 3, jnp.int32),
        "q_segment_ids": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) // 20, (b, t)),
        "kv_segment_ids": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) // 20, (b, t))},
}


@pytest.mark.parametrize("masks", MASKS, ids=list(MASKS))
@pytest.mark.parametrize("kv_heads", [4, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("spec", [P("data", None, "model", None), P(None, None, "model", None), P("data")],
                         ids=["batch-and-heads", "heads", "batch"])  # fmt: skip
def test_kernel_calls_are_partitioned(monkeypatch, spec, axis_type, kv_heads, masks):
    """The CUDA path's custom calls on sharded inputs: each device runs them on its own batch rows
    and heads (no collective, forward or backward), with the values of the unsharded call. The
    kernels are replaced by a pure-JAX stand-in (tests/fake_kernels.py), so this runs on CPU."""
    fake_kernels.install(monkeypatch)
    mesh = _mesh(axis_type)
    b, t, n = 4, 64, 8
    q, k, v = qkv(rng_for("partitioned", str(spec), kv_heads), jnp.bfloat16, b, t, t, n, kv_heads, 32)
    kv_spec = spec if kv_heads % 4 == 0 else P(spec[0])
    placed = [jax.device_put(q, NamedSharding(mesh, spec))]
    placed += [jax.device_put(x, NamedSharding(mesh, kv_spec)) for x in (k, v)]
    mask_args = MASKS[masks](b, t)
    placed_masks = {name: jax.device_put(x, NamedSharding(mesh, P(spec[0]))) for name, x in mask_args.items()
                    if isinstance(x, jax.Array)}  # fmt: skip

    def attn(q, k, v, mask_arrays):
        return jax_flash.attention(q, k, v, **{**mask_args, **mask_arrays}, implementation="cuda")

    def loss(q, k, v, mask_arrays):
        return jnp.sum(attn(q, k, v, mask_arrays).astype(jnp.float32) ** 2)

    fwd, grad = jax.jit(attn), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    assert not _collectives(fwd, *placed, placed_masks)
    # With one kv head and the query heads split, each device has part of dK and dV: one all-reduce.
    heads_split = len(spec) > 2 and spec[2] is not None
    expected = ["all-reduce"] if kv_heads == 1 and heads_split else []
    assert _collectives(grad, *placed, placed_masks) == expected
    out = fwd(*placed, placed_masks)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), out.ndim)
    unsharded = {name: x for name, x in mask_args.items() if isinstance(x, jax.Array)}
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(fwd(q, k, v, unsharded), np.float32))
    for mine, ref in zip(grad(*placed, placed_masks), grad(q, k, v, unsharded)):
        assert mine.sharding.is_equivalent_to(NamedSharding(mesh, spec if mine.shape == q.shape else kv_spec), 4)
        assert reference.rel_error(mine, ref) < 1e-2  # MQA: dK and dV add bf16 parts


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("bias_shape", [(1, 8, 64, 64), (4, 1, 1, 64)], ids=["heads-bias", "batch-bias"])
def test_kernel_calls_with_a_bias_are_partitioned(monkeypatch, axis_type, bias_shape):
    """A bias and a mask broadcast over the batch or the heads, split with the inputs where they
    are full: no collective but the one all-reduce that adds the bias gradient's parts over the
    axis it is broadcast along (batch or heads); values as unsharded."""
    fake_kernels.install(monkeypatch)
    mesh = _mesh(axis_type)
    b, t, n = 4, 64, 8
    rng = rng_for("partitioned-bias", bias_shape)
    q, k, v = qkv(rng, jnp.bfloat16, b, t, t, n, 4, 32)
    bias = jnp.asarray(rng.normal(size=bias_shape), jnp.float32)
    mask = jnp.asarray(rng.random((b, 1, t, t)) < 0.8)
    spec = P("data", None, "model", None)
    bias_spec = P(*(axis if size > 1 else None for axis, size in zip(("data", "model"), bias_shape)))
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    placed += [jax.device_put(bias, NamedSharding(mesh, bias_spec)), jax.device_put(mask, NamedSharding(mesh, P("data")))]

    def loss(q, k, v, bias, mask):
        out = jax_flash.attention(q, k, v, bias, mask, is_causal=True, implementation="cuda")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    fwd = jax.jit(lambda *args: jax_flash.attention(*args, is_causal=True, implementation="cuda"))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    assert not _collectives(fwd, *placed)
    assert _collectives(grad, *placed) == ["all-reduce"]
    np.testing.assert_array_equal(np.asarray(fwd(*placed), np.float32),
                                  np.asarray(fwd(q, k, v, bias, mask), np.float32))  # fmt: skip
    for mine, ref in zip(grad(*placed), grad(q, k, v, bias, mask)):
        assert reference.rel_error(mine, ref) < 1e-2


def test_kernel_calls_keep_heads_whole_when_kv_heads_cannot_follow(monkeypatch):
    """Query heads over 4 devices with 2 kv heads: no device would hold whole GQA groups, so the
    calls gather the heads instead (right values; the batch stays sharded)."""
    fake_kernels.install(monkeypatch)
    mesh = _mesh(AxisType.Auto)
    q, k, v = qkv(rng_for("partitioned-kv2"), jnp.bfloat16, 4, 40, 40, 8, 2, 32)
    placed = [jax.device_put(q, NamedSharding(mesh, P("data", None, "model", None)))]
    placed += [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (k, v)]
    attn = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True, implementation="cuda"))
    np.testing.assert_array_equal(np.asarray(attn(*placed), np.float32), np.asarray(attn(q, k, v), np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads", ["gqa", "mqa"])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("spec", [P("gpus"), P(None, None, "gpus", None)], ids=["batch", "heads"])
def test_kernels_on_sharded_gpu_inputs(spec, axis_type, kv_heads):
    """The CUDA kernels under jit with inputs sharded over every local GPU (2 or more): each GPU
    runs them on its own shard (no collective but MQA's dK/dV sum), and forward and gradients
    equal one GPU's."""
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip("sharding needs 2 or more GPUs")
    mesh = jax.make_mesh((len(gpus),), ("gpus",), axis_types=(axis_type,), devices=gpus)
    kv = 2 * len(gpus) if kv_heads == "gqa" else 1
    q, k, v = qkv(rng_for("sharding-gpu", str(spec), kv), jnp.bfloat16, 2 * len(gpus), 512, 512, 4 * len(gpus),
                  kv, 128)  # fmt: skip
    kv_spec = spec if kv > 1 else P(spec[0])
    placed = [jax.device_put(q, NamedSharding(mesh, spec))]
    placed += [jax.device_put(x, NamedSharding(mesh, kv_spec)) for x in (k, v)]
    single = [jax.device_put(x, gpus[0]) for x in (q, k, v)]
    attn = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True, implementation="cuda"))
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
    assert not _collectives(attn, *placed)
    assert _collectives(grad, *placed) == (["all-reduce"] if kv == 1 and spec != P("gpus") else [])
    # The forward is deterministic: equal bits. dQ adds its parts with atomics in any order.
    out = attn(*placed)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), 4)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(attn(*single), np.float32))
    for mine, ref in zip(grad(*placed), grad(*single)):
        assert reference.rel_error(mine, ref) < 1e-2


def test_kernel_results_vary_like_their_inputs_inside_shard_map():
    """An ffi_call's results carry no varying mesh axes; `_partition.vary_like` gives them the inputs'
    (else the gradient of a kernel call inside shard_map has cotangents of the wrong type)."""
    mesh = jax.make_mesh((2,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices("cpu")[:2])
    seen = {}

    def local(x):
        fresh = jnp.zeros(x.shape, x.dtype)  # like an ffi_call's result: varies over nothing
        (cast,) = _partition.vary_like((fresh,), x)
        seen["before"], seen["after"], seen["input"] = (_partition.varying_axes(a) for a in (fresh, cast, x))
        return cast + x

    jax.jit(shard_map(local, mesh=mesh, in_specs=P("sp"), out_specs=P("sp")))(jnp.ones((4, 3)))
    if not seen["input"]:
        pytest.skip("this jax does not type varying mesh axes")
    assert seen["before"] == frozenset() and seen["after"] == seen["input"] == {"sp"}
