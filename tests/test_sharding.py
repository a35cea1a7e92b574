"""jax_flash.attention under jit with inputs sharded over batch and heads (8 host devices, see
conftest.py): every device computes its own shard, forward and backward, with no collective in
the compiled program, and the values are those of the unsharded call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from jax_flash import _ffi
from tests import reference
from tests.cases import qkv, rng_for

shard_map = getattr(jax, "shard_map", None)
if shard_map is None:  # older jax
    from jax.experimental.shard_map import shard_map

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


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [P("gpus"), P(None, None, "gpus", None)], ids=["batch", "heads"])
def test_kernels_on_sharded_gpu_inputs(spec):
    """The CUDA kernels under jit with inputs sharded over every local GPU (2 or more): forward
    and gradients equal one GPU's, shard for shard. (The custom calls are not partitioned yet, so
    XLA gathers their inputs: the values are right, the collectives are not gone.)"""
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip("sharding needs 2 or more GPUs")
    mesh = jax.make_mesh((len(gpus),), ("gpus",), axis_types=(AxisType.Auto,), devices=gpus)
    q, k, v = qkv(rng_for("sharding-gpu", str(spec)), jnp.bfloat16, 2 * len(gpus), 512, 512, 4 * len(gpus),
                  2 * len(gpus), 128)  # fmt: skip
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    single = [jax.device_put(x, gpus[0]) for x in (q, k, v)]
    attn = lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True, implementation="cuda")  # noqa: E731
    grad = jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2))
    # The forward is deterministic: equal bits. dQ adds its parts with atomics in any order.
    np.testing.assert_array_equal(np.asarray(jax.jit(attn)(*placed), np.float32),
                                  np.asarray(jax.jit(attn)(*single), np.float32))
    for mine, ref in zip(jax.jit(grad)(*placed), jax.jit(grad)(*single)):
        assert reference.rel_error(mine, ref) < 1e-2


def test_kernel_results_vary_like_their_inputs_inside_shard_map():
    """An ffi_call's results carry no varying mesh axes; `_ffi.vary_like` gives them the inputs'
    (else the custom_vjp of a kernel call inside shard_map refuses its cotangents)."""
    mesh = jax.make_mesh((2,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices("cpu")[:2])
    seen = {}

    def local(x):
        fresh = jnp.zeros(x.shape, x.dtype)  # like an ffi_call's result: varies over nothing
        (cast,) = _ffi.vary_like((fresh,), x)
        seen["before"], seen["after"], seen["input"] = (_ffi._vma(a) for a in (fresh, cast, x))
        return cast + x

    jax.jit(shard_map(local, mesh=mesh, in_specs=P("sp"), out_specs=P("sp")))(jnp.ones((4, 3)))
    if not seen["input"]:
        pytest.skip("this jax does not type varying mesh axes")
    assert seen["before"] == frozenset() and seen["after"] == seen["input"] == {"sp"}
