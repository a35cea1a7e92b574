"""Edge shapes on CPU, on the xla path and on the CUDA path's Python (with the pure-JAX stand-in
for the kernels, tests/fake_kernels.py): empty inputs as `jax.nn.dot_product_attention` treats
them, one query or one key, many query heads over one kv head, the smallest head dims, and the
grid limit that decides whether the kernels can take a shape. What the kernels compute at these
shapes is tested on GPUs (test_cuda_edges.py)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ffi, _plan, cuda_impl
from jax_flash._validation import validate
from tests import fake_kernels, reference
from tests.cases import qkv, rng_for

IMPLEMENTATIONS = ["xla", "cuda-stand-in"]


def _implementation(name: str, monkeypatch) -> str:
    if name == "cuda-stand-in":
        fake_kernels.install(monkeypatch)
        return "cuda"
    return name


def _loss(implementation, **kw):
    def loss(q, k, v):
        out, lse = jax_flash.attention(q, k, v, implementation=implementation, return_residual=True, **kw)
        finite_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(finite_lse)

    return loss


EMPTY_SHAPES = {  # (query shape, key/value shape)
    "batch 0": ((0, 8, 4, 16), (0, 8, 2, 16)),
    "queries 0": ((2, 0, 4, 16), (2, 8, 2, 16)),
    "keys 0": ((2, 8, 4, 16), (2, 0, 2, 16)),
    "heads 0": ((2, 8, 0, 16), (2, 8, 2, 16)),
    "head dim 0": ((2, 8, 4, 0), (2, 5, 2, 0)),
}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("shapes", EMPTY_SHAPES, ids=list(EMPTY_SHAPES))
def test_empty_inputs_as_jax_nn(monkeypatch, implementation, shapes):
    """Outputs (values and shapes) as `jax.nn.dot_product_attention` gives them; no keys: every
    row empty (output 0, lse -inf); gradients of the inputs' shapes, 0 and never NaN."""
    implementation = _implementation(implementation, monkeypatch)
    q_shape, kv_shape = EMPTY_SHAPES[shapes]
    rng = rng_for("empty", shapes)
    q = jnp.asarray(rng.normal(size=q_shape), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=kv_shape), jnp.bfloat16) for _ in range(2))
    for is_causal in (False, True):
        out, lse = jax_flash.attention(q, k, v, is_causal=is_causal, implementation=implementation,
                                       return_residual=True)  # fmt: skip
        with np.errstate(divide="ignore"):  # jax.nn's default scale at H = 0
            expected = jax.nn.dot_product_attention(q, k, v, implementation="xla")
        assert out.shape == expected.shape == q_shape and lse.shape == q_shape[:3]
        np.testing.assert_array_equal(out, expected)
        if k.shape[1] == 0:  # every row empty
            assert not np.asarray(out).any() and np.all(np.asarray(lse) == -np.inf)
        else:
            scale = None if q.shape[3] else 1.0  # H = 0: no logits to scale (they are all 0)
            ref_out, ref_lse = reference.attention(q, k, v, is_causal=is_causal, scale=scale)
            np.testing.assert_allclose(out, ref_out, atol=1e-6)
            np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)
        grads = jax.grad(_loss(implementation, is_causal=is_causal), argnums=(0, 1, 2))(q, k, v)
        for grad, x in zip(grads, (q, k, v)):
            assert grad.shape == x.shape and not np.isnan(np.asarray(grad)).any()
        path = "none" if shapes != "head dim 0" else "cuda" if implementation == "cuda" else "xla-dense"
        assert jax_flash.chosen_implementation(q, k, v, implementation=implementation) == path
        if k.shape[1] == 0:  # no keys: nothing depends on the inputs
            assert all(not np.asarray(g).any() for g in grads)


def test_no_kv_heads_is_a_clear_error():
    q, k = jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 0, 8))
    with pytest.raises(ValueError, match="key must have at least one head"):
        jax_flash.attention(q, k, k)


SMALL_SHAPES = {  # b, t, s, n, kv_heads, h, kwargs
    "one query": (2, 1, 37, 4, 2, 32, {"is_causal": True}),
    "one key": (2, 37, 1, 4, 2, 32, {}),
    "one query, one key": (3, 1, 1, 2, 1, 64, {"is_causal": True}),
    "128 query heads over 1 kv head": (1, 24, 40, 128, 1, 32, {"is_causal": True}),
    "head dim 1": (2, 19, 23, 2, 1, 1, {}),
    "head dim 8": (2, 19, 23, 2, 1, 8, {"local_window_size": (4, 2)}),
    "head dim 16": (2, 19, 23, 2, 2, 16, {"is_causal": True}),
}


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=list(SMALL_SHAPES))
def test_small_shapes_against_the_reference(monkeypatch, implementation, shape):
    implementation = _implementation(implementation, monkeypatch)
    b, t, s, n, kv_heads, h, kw = SMALL_SHAPES[shape]
    q, k, v = qkv(rng_for("small", shape), jnp.bfloat16, b, t, s, n, kv_heads, h)
    attention = lambda q, k, v: jax_flash.attention(q, k, v, implementation=implementation,  # noqa: E731
                                                    return_residual=True, **kw)  # fmt: skip
    out, lse = jax.jit(attention)(q, k, v)  # jitted: one compilation, not one per operation
    ref_out, ref_lse = jax.jit(lambda q, k, v: reference.attention(q, k, v, **kw))(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert reference.rel_error(out, ref_out) < 1e-2
    assert reference.rel_error(lse, ref_lse) < 1e-4
    grads = jax.jit(jax.grad(_loss(implementation, **kw), argnums=(0, 1, 2)))(q, k, v)
    ref_grads = jax.jit(jax.grad(lambda q, k, v: _reference_loss(q, k, v, **kw), argnums=(0, 1, 2)))(q, k, v)
    for name, grad, ref in zip("qkv", grads, ref_grads):
        assert reference.rel_error(grad, ref) < 2e-2, name


def _reference_loss(q, k, v, **kw):
    out, lse = reference.attention(q, k, v, **kw)
    return jnp.sum(out**2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))


def _shape_only(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_batch_times_heads_past_the_grid_y_limit_runs_on_the_kernels(monkeypatch):
    """70,000 batch x heads (and kv heads), above gridDim.y's 65,535: the launchers split it into
    y and z (cuda/common/grid.cuh), so auto mode keeps the call on the kernels. Traced, not run."""
    fake_kernels.install(monkeypatch)
    q = k = _shape_only((4375, 64, 16, 64))
    assert _unsupported_reason(q, k) is None
    out = jax.eval_shape(lambda q, k: jax_flash.attention(q, k, k, is_causal=True, implementation="cuda"), q, k)
    assert out.shape == q.shape


def test_a_batch_times_heads_the_grid_cannot_split_is_refused_by_name(monkeypatch):
    """65,537 (a prime) x 2 heads has no split y x z with both at most 65,535: `implementation="cuda"`
    raises a ValueError naming the shape and the limit, and auto mode takes the xla path."""
    fake_kernels.install(monkeypatch)
    q = k = _shape_only((65537, 8, 2, 32))
    reason = _unsupported_reason(q, k)
    assert reason is not None and "65537 x 2 = 131074" in reason and str(cuda_impl.MAX_GRID_YZ) in reason
    with pytest.raises(ValueError, match="no split into the CUDA grid"):
        jax.eval_shape(lambda q, k: jax_flash.attention(q, k, k, implementation="cuda"), q, k)


@pytest.mark.parametrize("batch_heads,fits", [(1, True), (65535, True), (70000, True), (32768 * 65535, True),
                                              (65537, False), (2 * 65537, False), (65535 * 65535, False)])
def test_the_grid_split_rule(batch_heads, fits):
    """y x z, each at most 65,535, and the product within the kernels' 32-bit index."""
    assert cuda_impl.grid_fits(batch_heads) is fits


@pytest.mark.parametrize("capability,runs", [((7, 0), False), ((7, 5), True), ((8, 0), True), ((8, 6), True),
                                             ((8, 9), True), ((9, 0), True), ((10, 0), True), ((12, 0), True)])  # fmt: skip
def test_the_kernels_run_only_where_they_have_machine_code(monkeypatch, capability, runs):
    """Auto mode takes the kernels on Turing (float16: test_turing_dispatch.py), Ampere, Ada, Hopper
    and (from the default build's PTX) Blackwell; on Volta it takes another path (cuDNN where
    jax.nn's runs, which it does not on this CPU: test_cudnn_fallback.py; so xla here), and
    `implementation="cuda"` says why."""
    fake_kernels.install(monkeypatch)
    monkeypatch.setattr(_ffi, "device_capability", lambda: capability)
    q = k = _shape_only((2, 64, 4, 64), jnp.float16)
    assert jax_flash.chosen_implementation(q, k, k) == ("cuda" if runs else "xla-dense")
    if not runs:
        with pytest.raises(ValueError, match=f"compute capability 7.5 or newer .* this GPU is {capability[0]}"):
            jax_flash.chosen_implementation(q, k, k, implementation="cuda")


@pytest.mark.parametrize("archs,capability,runs", [
    (("80", "90a"), (8, 0), True), (("80", "90a"), (8, 6), True), (("80", "90a"), (9, 0), True),
    (("86",), (8, 0), False), (("86",), (8, 9), True),  # sm_XY code runs on X.Z, Z >= Y
    (("90a",), (8, 6), False), (("80",), (9, 0), False),  # sm_80 code does not run on Hopper
    (("80",), (10, 0), False), (("80", "80-virtual"), (10, 0), True), (("80-virtual",), (12, 0), True),
    (("86-virtual",), (8, 0), False),  # PTX runs from its own capability on
])  # fmt: skip
def test_the_kernels_run_only_where_the_install_has_their_machine_code(monkeypatch, archs, capability, runs):
    """An install built for other GPUs (JAX_FLASH_CUDA_ARCHS, e.g. native on another machine) never
    launches kernels without code for this one: auto mode takes another path, and
    `implementation="cuda"` names the targets it has."""
    fake_kernels.install(monkeypatch)
    monkeypatch.setattr(_ffi, "device_capability", lambda: capability)
    monkeypatch.setattr(_ffi, "built_archs", lambda: archs)
    q = k = _shape_only((2, 64, 4, 64))
    assert (jax_flash.chosen_implementation(q, k, k) == "cuda") is runs
    if not runs:
        with pytest.raises(ValueError, match=f"machine code for sm_{archs[0]}.*this GPU \\({capability[0]}"):
            jax_flash.chosen_implementation(q, k, k, implementation="cuda")


def test_the_built_targets_are_read_from_the_extension(monkeypatch):
    monkeypatch.setattr(_ffi, "extension", lambda: type("Module", (), {"built_archs": "86,90a,80-virtual"}))
    assert _ffi.built_archs() == ("86", "90a", "80-virtual")
    monkeypatch.setattr(_ffi, "extension", lambda: object())  # a module from before it said
    assert _ffi.built_archs() == _ffi.UNNAMED_BUILT_ARCHS


@pytest.mark.parametrize("off_hopper,runs", [(("80", "80-virtual"), True), (("80",), False)])
def test_forcing_the_mma_sync_family_on_hopper_needs_its_code(monkeypatch, off_hopper, runs):
    """Without the test families the mma.sync files that Hopper has its own kernels for carry no
    sm_90a code: forced on Hopper they run from the PTX (80-virtual) where it was built, else the
    forced call says which targets it has."""
    fake_kernels.install(monkeypatch)
    monkeypatch.setattr(_ffi, "family_archs", lambda: {**fake_kernels.TEST_BUILD_FAMILY_ARCHS,
                                                       "mma_sync_off_hopper": off_hopper})  # fmt: skip
    monkeypatch.setenv(_plan.KERNELS_ENV, "sm80")
    q = k = _shape_only((2, 64, 4, 64))
    assert (jax_flash.chosen_implementation(q, k, k) == "cuda") is runs
    if not runs:
        with pytest.raises(ValueError, match="machine code for sm_80, none of which runs on this GPU \\(9.0\\)"):
            jax_flash.chosen_implementation(q, k, k, implementation="cuda")


def test_the_family_targets_are_read_from_the_extension(monkeypatch):
    listed = "hopper=90a turing=75 mma_sync=80,90a,80-virtual mma_sync_off_hopper=80,80-virtual"
    monkeypatch.setattr(_ffi, "extension", lambda: type("Module", (), {"family_archs": listed}))
    assert _ffi.family_archs() == {"hopper": ("90a",), "turing": ("75",), "mma_sync": ("80", "90a", "80-virtual"),
                                   "mma_sync_off_hopper": ("80", "80-virtual")}  # fmt: skip
    module = type("Module", (), {"built_archs": "75,80,90a"})  # a module from before it said
    monkeypatch.setattr(_ffi, "extension", lambda: module)
    assert _ffi.family_archs()["turing"] == ("75", "90a") and _ffi.family_archs()["mma_sync"] == ("75", "80", "90a")


def _unsupported_reason(q, k):
    """What `unsupported_reason` says of attention(q, k, k), from shapes alone."""
    none = dict(scale=None, is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                local_window_size=None, implementation=None, return_residual=False, softcap=None,
                q_segment_ids=None, kv_segment_ids=None)  # fmt: skip
    reasons = []

    def trace(q, k):
        reasons.append(cuda_impl.unsupported_reason(validate(q, k, k, None, None, **none)))
        return q

    jax.eval_shape(trace, q, k)
    return reasons[0]
