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
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # older jax
        from jax.experimental.shard_map import shard_map
    attn = lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True, implementation="xla")  # noqa: E731
    per_device = shard_map(attn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    np.testing.assert_allclose(jax.jit(per_device)(q, k, v), attn(q, k, v), rtol=1e-5, atol=1e-6)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) ** 2)  # noqa: E731
    for mine, ref in zip(jax.jit(jax.grad(loss(per_device), argnums=(0, 1, 2)))(q, k, v),
                         jax.grad(loss(attn), argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(mine, ref, rtol=1e-4, atol=1e-5)
