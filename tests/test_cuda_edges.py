"""Edge shapes on the CUDA kernels, in both kernel families (marked `gpu`): batch x heads past the
grid's y limit of 65,535, a tensor of more than 2^31 elements, one query or one key, 128 query
heads over one kv head, the smallest head dims and empty inputs. The large ones are also marked
`large` (seconds each, tens of GB): scripts/gpu_check.sh runs them; `-m "gpu and not large"` skips
them. Their outputs and gradients are checked on sampled batch rows and heads against the float64
reference (each batch row and head is independent of the others)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ffi, _plan
from tests import reference
from tests.cases import rng_for
from tests.test_cuda import FWD_TOL, GRAD_TOL, check, poison_free_memory

pytestmark = pytest.mark.gpu

FAMILIES = ["best", "sm80"]


def _forward_and_gradients(q, k, v, g_out, implementation="cuda", **kw):
    """Output, lse and (dq, dk, dv) of sum(out * g_out) on the kernels (or `implementation`)."""

    def loss(q, k, v):
        return jnp.sum(jax_flash.attention(q, k, v, implementation=implementation, **kw).astype(jnp.float32) * g_out)

    poison_free_memory()
    out, lse = jax.jit(lambda q, k, v: jax_flash.attention(
        q, k, v, implementation=implementation, return_residual=True, **kw))(q, k, v)  # fmt: skip
    poison_free_memory()
    return out, lse, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


def _random_on_device(rng, q_shape, kv_shape):
    """Fresh normal bf16 q, k, v and output cotangent, drawn on the GPU (NumPy would take minutes
    for tensors of billions of elements)."""
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), 4)
    shapes = (q_shape, kv_shape, kv_shape, q_shape)
    return tuple(jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip(keys, shapes))


def _reference(q, k, v, g_out, **kw):
    out, lse = reference.attention(q, k, v, **kw)
    grads = jax.grad(lambda q, k, v: jnp.sum(reference.attention(q, k, v, **kw)[0] * g_out), argnums=(0, 1, 2))
    return out, lse, grads(q, k, v)


@pytest.mark.large
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n,kv_heads", [(16, 16), (32, 4)], ids=["heads-and-kv-heads", "query-heads"])
def test_batch_times_heads_above_the_grid_y_limit(monkeypatch, family, n, kv_heads):
    """B = 4,375 x 16 heads (and kv heads) = 70,000, or x 32 query heads over 4 kv heads: above
    gridDim.y's 65,535 (the launchers split it into y x z), forward and backward, T = 64."""
    monkeypatch.setenv(_plan.KERNELS_ENV, family)
    b, t, h = 4375, 64, 64
    q, k, v, g_out = _random_on_device(rng_for("grid-y", n, kv_heads), (b, t, n, h), (b, t, kv_heads, h))
    out, lse, grads = _forward_and_gradients(q, k, v, g_out, is_causal=True)
    rows = np.array([0, 1, b // 2, b - 2, b - 1])  # both ends of the grid's y and z
    mine = (out[rows], lse[rows], *(g[rows] for g in grads))
    expected = _reference(q[rows], k[rows], v[rows], g_out[rows], is_causal=True)
    expected = (expected[0], expected[1], *expected[2])
    for name, bound, x, ref in zip(["out", "lse", "dq", "dk", "dv"], [FWD_TOL, 1e-4] + [GRAD_TOL] * 3, mine, expected):
        assert reference.rel_error(x, ref) < bound, name


def _separable_cotangent(t: int, n: int, h: int, rows=slice(None), heads=slice(None)):
    """An output cotangent [1, T, N, H] built from one vector per axis (made where it is used, never
    stored whole: a float32 one of 2^31 elements is 9 GB), or its [rows, heads] part in float64."""
    lib = jnp if rows == slice(None) else np
    i, head, col = (lib.arange(size, dtype=lib.float32 if lib is jnp else np.float64) for size in (t, n, h))
    return (lib.cos(0.37 * i[rows])[:, None, None] * lib.cos(0.5 * head[heads][:, None] + 0.11 * col))[None]


@pytest.mark.large
@pytest.mark.parametrize("family", FAMILIES)
def test_tensors_above_2_to_the_31_elements(monkeypatch, family):
    """q, k, v of 139,264 x 128 heads x 128 = 2.28e9 elements each (causal), forward and backward.
    Checked on the last head's last 128 queries and keys, whose offsets pass 2^31: with a causal
    mask those keys are seen by those queries alone, so a reference over them and every key of that
    head gives their dK and dV exactly. No poisoned memory here: the values are checked, and with
    it (and with float64 enabled, as conftest.py does) XLA's GPU compiler crashed on this forward
    (a segmentation fault, jaxlib 0.11.2, 2026-11-27), which the same program alone did not."""
    monkeypatch.setenv(_plan.KERNELS_ENV, family)
    t, n, h, tail = 139264, 128, 128, 128
    with jax.enable_x64(False):
        q, k, v, _ = _random_on_device(rng_for("2^31", family), (1, t, n, h), (1, t, n, h))
        assert q.size > 2**31
        out, lse = jax.jit(lambda q, k, v: jax_flash.attention(
            q, k, v, is_causal=True, implementation="cuda", return_residual=True))(q, k, v)  # fmt: skip

        def loss(q, k, v):
            out = jax_flash.attention(q, k, v, is_causal=True, implementation="cuda")
            return jnp.sum(out.astype(jnp.float32) * _separable_cotangent(t, n, h))

        dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    last = slice(n - 1, n)
    head = lambda x: np.asarray(x[:, :, last], np.float64)  # noqa: E731
    g_tail = _separable_cotangent(t, n, h, rows=slice(t - tail, t), heads=last)
    ref = _reference(head(q)[:, -tail:], head(k), head(v), g_tail, is_causal=True)
    mine = (out[:, -tail:, last], lse[:, -tail:, last], dq[:, -tail:, last], dk[:, -tail:, last], dv[:, -tail:, last])
    expected = (ref[0], ref[1], ref[2][0], ref[2][1][:, -tail:], ref[2][2][:, -tail:])
    for name, bound, x, r in zip(["out", "lse", "dq", "dk", "dv"], [FWD_TOL, 1e-4] + [GRAD_TOL] * 3, mine, expected):
        assert reference.rel_error(x, r) < bound, name


SMALL = {  # b, t, s, n, kv_heads, h, kwargs
    "one query": (2, 1, 300, 4, 2, 128, {"is_causal": True}),
    "one key": (2, 300, 1, 4, 2, 128, {}),
    "one query, one key": (3, 1, 1, 4, 1, 64, {"is_causal": True}),
    "128 query heads over 1 kv head": (1, 100, 200, 128, 1, 64, {"is_causal": True}),
    "head dim 1": (2, 70, 90, 2, 1, 1, {}),
    "head dim 8": (2, 70, 90, 2, 1, 8, {"local_window_size": (20, 5)}),
    "head dim 16": (2, 70, 90, 4, 2, 16, {"is_causal": True}),
}


@pytest.mark.parametrize("shape", SMALL, ids=list(SMALL))
def test_small_shapes(shape):
    """Against the float64 reference and the xla path, in both families (tests/test_cuda.check)."""
    b, t, s, n, kv_heads, h, kw = SMALL[shape]
    check(jnp.bfloat16, b, t, s, n, kv_heads, h, **kw)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("t,s,h", [(1, 1, 64), (7, 1, 64), (1, 7, 64), (70, 90, 1)])
def test_the_xla_path_on_the_gpu_with_a_side_of_one(dtype, t, s, h):
    """The xla path's products on a GPU (dense_impl.py) with T, S or the head dim 1, which XLA
    turns into elementwise products (in 16 bits float16 failed there, "Unsupported dot precision
    algorithm", and bfloat16 rounded the lse to 16 bits); against the float64 reference, forward
    and gradients."""
    rng = rng_for("xla on gpu", dtype, t, s, h)
    q, k, v = (jnp.asarray(rng.normal(size=(2, n, 4, h)), dtype) for n in (t, s, s))
    g_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    out, lse, grads = _forward_and_gradients(q, k, v, g_out, implementation="xla")
    ref_out, ref_lse, ref_grads = _reference(q, k, v, g_out)
    assert reference.rel_error(out, ref_out) < FWD_TOL
    assert reference.rel_error(lse, ref_lse) < 1e-4
    for name, g, r in zip("qkv", grads, ref_grads):
        assert reference.rel_error(g, r) < GRAD_TOL, f"d{name}"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("q_shape,kv_shape", [((0, 8, 4, 64), (0, 8, 2, 64)), ((2, 0, 4, 64), (2, 8, 2, 64)),
                                              ((2, 8, 4, 64), (2, 0, 2, 64))], ids=["B=0", "T=0", "S=0"])  # fmt: skip
def test_empty_inputs(monkeypatch, family, q_shape, kv_shape):
    """As jax.nn: an empty output, or with no keys zeros and lse -inf; zero gradients, no NaN."""
    monkeypatch.setenv(_plan.KERNELS_ENV, family)
    rng = rng_for("cuda-empty", q_shape, kv_shape)
    q = jnp.asarray(rng.normal(size=q_shape), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=kv_shape), jnp.bfloat16) for _ in range(2))
    out, lse, grads = _forward_and_gradients(q, k, v, jnp.ones(q_shape, jnp.float32), is_causal=True)
    np.testing.assert_array_equal(out, jax.nn.dot_product_attention(q, k, v))
    assert out.shape == q_shape and lse.shape == q_shape[:3] and np.all(np.asarray(lse) == -np.inf)
    for grad, x in zip(grads, (q, k, v)):
        assert grad.shape == x.shape and not np.asarray(grad, np.float32).any()


# (limit, head dim, whether backward kernels run): sm_86/89's 99 KB take the compact mma.sync tiles
# at 32, 64, 96 and 128 and the xla path's backward at 256; an A100's 163 KB the usual tiles at 96
# and the compact ones at 256 (cuda/sm80/config.cuh).
SMALLER_GPUS = [(101376, 32, True), (101376, 64, True), (101376, 128, True), (101376, 96, True),
                (101376, 256, False), (166912, 96, True), (166912, 256, True)]  # fmt: skip


def _documents(rng, b, t, **kw):
    """Sorted segment ids, the same for queries and keys (up to 3 documents a row), and kw."""
    ids = jnp.asarray(np.sort(rng.integers(0, 3, size=(b, t)), axis=1), jnp.int32)
    return dict(q_segment_ids=ids, kv_segment_ids=ids, **kw)


# Each kernel variant (params.h): plain, masked (ragged lengths, or segment ids with a window),
# soft cap, bias (differentiated, with a boolean mask). Drawn only for the variant a case runs.
VARIANTS = {
    "plain": lambda rng, b, t, n: dict(),
    "lengths": lambda rng, b, t, n: dict(is_causal=True, query_seq_lengths=jnp.asarray([t, 171], jnp.int32),
                                         key_value_seq_lengths=jnp.asarray([t, 171], jnp.int32)),
    "segments-window": lambda rng, b, t, n: _documents(rng, b, t, local_window_size=(100, 30)),
    "softcap": lambda rng, b, t, n: dict(is_causal=True, softcap=20.0),
    "bias-mask": lambda rng, b, t, n: dict(bias=jnp.asarray(rng.normal(size=(1, n, t, t)), jnp.float32),
                                           mask=jnp.asarray(rng.random((b, 1, t, t)) < 0.9)),
}  # fmt: skip


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("limit,h,kernels", SMALLER_GPUS, ids=[f"{lim // 1024}KB-d{h}" for lim, h, _ in SMALLER_GPUS])
def test_a_gpu_with_less_shared_memory(monkeypatch, limit, h, kernels, variant):
    """The mma.sync kernels as an sm_86/89 or an A100 takes them (JAX_FLASH_SMEM_LIMIT): the
    forward kernels fit (at most 96 KB); the backward runs the tiles that fit, or where none does
    auto mode takes the xla path's backward. GQA, every kernel variant, T = 300 (several query
    blocks a key block, in one stage's turns), gradients (the bias's too) against the float64
    reference."""
    monkeypatch.setenv(_plan.KERNELS_ENV, "sm80")
    monkeypatch.setenv(_ffi.SMEM_LIMIT_ENV, str(limit))
    rng = rng_for("cuda-smem-limit", limit, h, variant)
    b, t, n = 2, 300, 4
    q = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(b, t, 2, h)), jnp.bfloat16) for _ in range(2))
    g_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    kw = VARIANTS[variant](rng, b, t, n)
    bias = kw.pop("bias", jnp.zeros((), jnp.float32))
    with_bias = variant == "bias-mask"

    def loss(attend, q, k, v, bias):
        return jnp.sum(attend(q, k, v, bias).astype(jnp.float32) * g_out)

    def ours(q, k, v, bias):
        return jax_flash.attention(q, k, v, bias if with_bias else None, **kw)

    def ref(q, k, v, bias):
        return reference.attention(q, k, v, bias if with_bias else None, **kw)[0]

    grad = jax.jit(jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2, 3)))
    assert "jax_flash_fwd" in jax.jit(ours).lower(q, k, v, bias).as_text()
    assert ("jax_flash_bwd" in grad.lower(q, k, v, bias).as_text()) is kernels
    grads = grad(q, k, v, bias)
    ref_grads = jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for name, mine, want in zip(["dq", "dk", "dv", "dbias"], grads, ref_grads):
        if name == "dbias" and not with_bias:
            continue
        assert not np.isnan(np.asarray(mine, np.float32)).any(), name
        assert reference.rel_error(mine, want) < GRAD_TOL, name
    assert reference.rel_error(ours(q, k, v, bias), ref(q, k, v, bias)) < FWD_TOL


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_a_plan_the_launchers_cannot_run_is_refused_by_name(monkeypatch, which):
    """Tiles the mma.sync launchers do not have (Hopper's tall rows, its 80-query steps) in a
    plan: the handler's error names the plan, and nothing runs with other tiles instead."""
    monkeypatch.setenv(_plan.KERNELS_ENV, "sm80")
    if which == "forward":
        monkeypatch.setattr(_plan, "forward_tiles", lambda *a: _plan.Tiles.TALL)
    else:
        monkeypatch.setattr(_plan, "backward_tiles", lambda *a: _plan.Tiles.STEPS_OF_80)
    rng = rng_for("cuda-refused-plan", which)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 256, 2, 64)), jnp.bfloat16) for _ in range(3))
    loss = lambda q: jax_flash.attention(q, k, v, implementation="cuda").astype(jnp.float32).sum()  # noqa: E731
    tiles = int(_plan.Tiles.TALL if which == "forward" else _plan.Tiles.STEPS_OF_80)
    with pytest.raises(Exception, match=rf"the plan \(family 80, tiles {tiles}\) or its operands cannot run this {which}"):
        np.asarray(jax.jit(jax.grad(loss))(q))
