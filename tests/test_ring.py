"""jax_flash.ring_attention on a sequence sharded over 4 host devices (conftest.py forces 8): the
output and the gradients equal those of single-device attention over the whole sequence, the
only collectives are the ring's collective-permutes, and the zigzag layout helpers invert."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from jax_flash._partition import shard_map
from tests import fake_kernels, reference
from tests.cases import qkv, rng_for

RING = 4


def _mesh():
    devices = jax.devices("cpu")
    if len(devices) < RING:
        pytest.fail("conftest.py asks for 8 host devices; XLA_FLAGS was overridden")
    return jax.make_mesh((RING,), ("sp",), axis_types=(AxisType.Auto,), devices=devices[:RING])


def _ring_fn(mesh, is_causal, implementation="xla"):
    spec = P(None, "sp", None, None)

    def local(q, k, v):
        return jax_flash.ring_attention(q, k, v, axis_name="sp", is_causal=is_causal, implementation=implementation)

    return shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)


# Two cases rather than the full product: each compiles a 4-step ring forward and backward.
@pytest.mark.parametrize("is_causal, heads", [(False, (4, 4)), (True, (4, 2))], ids=["full-mha", "causal-gqa"])
def test_ring_matches_single_device(is_causal, heads):
    n, kv_heads = heads
    mesh = _mesh()
    q, k, v = qkv(rng_for("ring", is_causal, heads), jnp.float32, 2, 64, 64, n, kv_heads, 16)
    ring = _ring_fn(mesh, is_causal)
    # Causal rings take the sequence in zigzag order (balanced work per device).
    order = (lambda x: jax_flash.zigzag(x, RING)) if is_causal else (lambda x: x)
    restore = (lambda x: jax_flash.unzigzag(x, RING)) if is_causal else (lambda x: x)
    cotangent = jnp.asarray(rng_for("ring-dout", is_causal).normal(size=q.shape), jnp.float32)

    def ring_loss(q, k, v):
        return jnp.sum(restore(ring(order(q), order(k), order(v))) * cotangent)

    def single_loss(q, k, v):
        out = jax_flash.attention(q, k, v, is_causal=is_causal, implementation="xla")
        return jnp.sum(out * cotangent)

    out = jax.jit(lambda q, k, v: restore(ring(order(q), order(k), order(v))))(q, k, v)
    ref = jax_flash.attention(q, k, v, is_causal=is_causal, implementation="xla")
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)
    grads = jax.jit(jax.grad(ring_loss, argnums=(0, 1, 2)))(q, k, v)
    refs = jax.jit(jax.grad(single_loss, argnums=(0, 1, 2)))(q, k, v)
    for name, mine, theirs in zip("qkv", grads, refs):
        np.testing.assert_allclose(mine, theirs, rtol=2e-4, atol=2e-5, err_msg=f"d{name}")


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_ring_with_sinks_matches_float64(is_causal):
    """Sinks join once, after the ring's last merge: output and gradients (d sinks too, and the
    ring's backward now taking the lse's cotangent) against the float64 reference."""
    mesh = _mesh()
    rng = rng_for("ring-sinks", is_causal)
    q, k, v = qkv(rng, jnp.float32, 2, 64, 64, 4, 2, 16)
    sinks = jnp.asarray(rng.normal(size=(4,)) * 2, jnp.float32)
    spec = P(None, "sp", None, None)
    ring = shard_map(lambda q, k, v, s: jax_flash.ring_attention(q, k, v, axis_name="sp", is_causal=is_causal,
                                                                 sinks=s, implementation="xla"),
                     mesh=mesh, in_specs=(spec, spec, spec, P()), out_specs=spec)  # fmt: skip
    order = (lambda x: jax_flash.zigzag(x, RING)) if is_causal else (lambda x: x)
    restore = (lambda x: jax_flash.unzigzag(x, RING)) if is_causal else (lambda x: x)
    cotangent = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    ours = lambda q, k, v, s: restore(ring(order(q), order(k), order(v), s))  # noqa: E731
    ref = lambda q, k, v, s: reference.attention(q, k, v, is_causal=is_causal, sinks=s)[0]  # noqa: E731
    assert reference.rel_error(jax.jit(ours)(q, k, v, sinks), ref(q, k, v, sinks)) < 1e-5
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(ours(*a) * cotangent), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    refs = jax.grad(lambda *a: jnp.sum(ref(*a) * cotangent), argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for name, mine, theirs in zip(("dq", "dk", "dv", "dsinks"), grads, refs, strict=True):
        assert reference.rel_error(mine, theirs) < 1e-4, name


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_ring_forward_mode_matches_single_device(is_causal):
    """jax.jvp through the ring: each block's tangent by its attention's rule, merged as the
    outputs are; the gradient still comes from the ring's backward (the test above)."""
    mesh = _mesh()
    rng = rng_for("ring-jvp", is_causal)
    q, k, v = qkv(rng, jnp.float32, 2, 64, 64, 4, 2, 16)
    tangents = tuple(jnp.asarray(rng.normal(size=x.shape), jnp.float32) for x in (q, k, v))
    ring = _ring_fn(mesh, is_causal)
    order = (lambda x: jax_flash.zigzag(x, RING)) if is_causal else (lambda x: x)
    restore = (lambda x: jax_flash.unzigzag(x, RING)) if is_causal else (lambda x: x)
    ours = jax.jit(lambda p, t: jax.jvp(lambda *a: restore(ring(*map(order, a))), p, t)[1])((q, k, v), tangents)
    single = lambda *a: jax_flash.attention(*a, is_causal=is_causal, implementation="xla")  # noqa: E731
    ref = jax.jit(lambda p, t: jax.jvp(single, p, t)[1])((q, k, v), tangents)
    assert reference.rel_error(ours, ref) < 1e-5


@pytest.mark.parametrize("h", [32, 320])
def test_ring_on_the_kernel_path(monkeypatch, h):
    """The ring's CUDA branch (kernel calls inside shard_map, their results' varying axes, the
    backward from the whole sequence's lse) on CPU, with a pure-JAX stand-in for the kernels; at
    320 the forward kernel and the xla path's backward."""
    fake_kernels.install(monkeypatch)
    q, k, v = qkv(rng_for("ring-kernel-path", h), jnp.bfloat16, 2, 64, 64, 4, 2, h)
    ring = _ring_fn(_mesh(), True, implementation="cuda")
    zig, unzig = (lambda x: jax_flash.zigzag(x, RING)), (lambda x: jax_flash.unzigzag(x, RING))  # noqa: E731
    ring_loss = lambda q, k, v: jnp.sum(unzig(ring(zig(q), zig(k), zig(v))).astype(jnp.float32) ** 2)  # noqa: E731
    single = lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True, implementation="xla")  # noqa: E731
    single_loss = lambda q, k, v: jnp.sum(single(q, k, v).astype(jnp.float32) ** 2)  # noqa: E731
    out = jax.jit(lambda q, k, v: unzig(ring(zig(q), zig(k), zig(v))))(q, k, v)
    assert reference.rel_error(out, single(q, k, v)) < 1e-2
    for mine, theirs in zip(jax.jit(jax.grad(ring_loss, argnums=(0, 1, 2)))(q, k, v),
                            jax.jit(jax.grad(single_loss, argnums=(0, 1, 2)))(q, k, v)):  # fmt: skip
        assert reference.rel_error(mine, theirs) < 2e-2


def test_ring_communicates_only_by_permutes():
    mesh = _mesh()
    q, k, v = qkv(rng_for("ring-hlo"), jnp.float32, 1, 32, 32, 2, 2, 8)
    sharding = NamedSharding(mesh, P(None, "sp", None, None))
    placed = [jax.device_put(x, sharding) for x in (q, k, v)]
    ring = _ring_fn(mesh, True)
    loss = lambda q, k, v: jnp.sum(ring(q, k, v) ** 2)  # noqa: E731
    for fn in (jax.jit(ring), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))):
        hlo = fn.lower(*placed).compile().as_text()
        assert "collective-permute" in hlo
        found = [c for c in ("all-gather", "all-to-all", "reduce-scatter") if c in hlo]
        assert not found, f"the ring gathers: {found}"


def test_zigzag_round_trip_and_layout():
    x = jnp.arange(2 * 16).reshape(2, 16)
    z = jax_flash.zigzag(x, 4, axis=1)
    # Device r (2 chunks of 2) holds chunks r and 7 - r of the 8 chunks.
    np.testing.assert_array_equal(z[0, :4], [0, 1, 14, 15])
    np.testing.assert_array_equal(z[0, 4:8], [2, 3, 12, 13])
    np.testing.assert_array_equal(jax_flash.unzigzag(z, 4, axis=1), x)


def test_ring_rejects_bad_slices():
    q = jnp.zeros((1, 7, 2, 8))
    with pytest.raises(ValueError, match="even"):
        jax_flash.ring_attention(q, q, q, axis_name="sp", is_causal=True)
    with pytest.raises(ValueError, match="ranks"):
        jax_flash.ring_attention(q[0], q[0], q[0], axis_name="sp")


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_ring_on_gpus_matches_single_gpu(is_causal):
    """The CUDA kernels in a ring over every local GPU (2 or more), bf16, against one GPU."""
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip("a ring needs 2 or more GPUs")
    ring_size = len(gpus)
    mesh = jax.make_mesh((ring_size,), ("sp",), axis_types=(AxisType.Auto,), devices=gpus)
    spec = P(None, "sp", None, None)
    local = lambda q, k, v: jax_flash.ring_attention(q, k, v, axis_name="sp", is_causal=is_causal)  # noqa: E731
    ring = shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    # Uncommitted inputs: jit places them on the ring's GPUs, and on one GPU for the reference.
    q, k, v = qkv(rng_for("ring-gpu", is_causal), jnp.bfloat16, 1, 1024 * ring_size, 1024 * ring_size, 8, 2, 128)
    order = (lambda x: jax_flash.zigzag(x, ring_size)) if is_causal else (lambda x: x)
    restore = (lambda x: jax_flash.unzigzag(x, ring_size)) if is_causal else (lambda x: x)
    ring_loss = lambda q, k, v: jnp.sum(restore(ring(order(q), order(k), order(v))).astype(jnp.float32) ** 2)  # noqa: E731
    single_loss = lambda q, k, v: jnp.sum(jax_flash.attention(q, k, v, is_causal=is_causal).astype(jnp.float32) ** 2)  # noqa: E731
    out = jax.jit(lambda q, k, v: restore(ring(order(q), order(k), order(v))))(q, k, v)
    ref = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, is_causal=is_causal))(q, k, v)
    rel = lambda a, b: float(jnp.linalg.norm((a.astype(jnp.float32) - b.astype(jnp.float32)).ravel()) / jnp.linalg.norm(b.astype(jnp.float32).ravel()))  # noqa: E731
    assert rel(out, ref) < 1e-2
    for mine, theirs in zip(jax.jit(jax.grad(ring_loss, argnums=(0, 1, 2)))(q, k, v),
                            jax.jit(jax.grad(single_loss, argnums=(0, 1, 2)))(q, k, v)):
        assert rel(mine, theirs) < 2e-2


@pytest.mark.gpu
@pytest.mark.timing
def test_ring_hides_its_communication():
    """`python -m jax_flash.bench --ring` at 32768 tokens per GPU: the ring's forward + backward
    takes at most 1.2x the time one GPU takes for the block pairs of one ring member (issue 7)."""
    if len(jax.devices("gpu")) < 2:
        pytest.skip("a ring needs 2 or more GPUs")
    from jax_flash.bench import ring as bench_ring

    rows = bench_ring.run(32768)
    for row in rows:
        if row["pass"] == "fwd + bwd":
            assert row["ring"] <= 1.2 * row["one_gpu"], bench_ring.table(rows)
