"""The CUDA kernels (marked `gpu`: skipped without a CUDA GPU and the compiled extension).

Every check draws fresh random inputs, fills the GPU allocator's free memory with NaN first (so an
output element the kernel never writes shows up as NaN), and compares against the float64
reference and the xla path on the same inputs.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ffi, _plan
from tests import reference
from tests.cases import qkv, rng_for

pytestmark = pytest.mark.gpu

FWD_TOL, GRAD_TOL = 1e-2, 2e-2  # bf16/fp16 relative error bounds against float64
# Our error may be this many times the xla path's (plus 1e-3). With logits in the hundreds or
# thousands (key_growth), the backward kernels rebuild P from a recomputed S against the
# forward's lse, and the Hopper one rounds P and dP - delta to bf16 before their product (perf
# log B18): their dQ and dK then carry 2-2.4x the xla path's error (d = 64, growth 300, H100,
# 2026-11-27: Hopper 9.2e-3, mma.sync 7.8e-3, xla 3.9e-3; 1.0-1.1x at ordinary logits).
XLA_ERROR_FACTOR, STEEP_XLA_ERROR_FACTOR = 2.0, 2.5


def poison_free_memory():
    """Allocate and free ~1 GiB of NaN so the next outputs likely land on NaN-filled memory."""
    junk = jnp.full((256 * 1024 * 1024,), jnp.nan, jnp.float32)
    junk.block_until_ready()
    del junk


def beyond_the_cap(error: ValueError) -> bool:
    """Whether `error` is implementation="cuda" refusing a gradient whose backward kernels do not
    fit the shared-memory cap the grid runs under (JAX_FLASH_SMEM_LIMIT, as an sm_86/89 GPU would):
    it must say so, and auto mode takes the xla path's backward on the kernels' forward there."""
    return bool(os.environ.get(_ffi.SMEM_LIMIT_ENV)) and "shared memory" in str(error)


def gradients_within_the_cap(implementation, gradients):
    """gradients(implementation); where implementation="cuda" refuses them under the shared-memory
    cap (beyond_the_cap), auto mode's, gradients(None), which are checked instead."""
    try:
        return gradients(implementation)
    except ValueError as e:
        if implementation != "cuda" or not beyond_the_cap(e):
            raise
        return gradients(None)


def run(implementation, q, k, v, g_out, **kw):
    """Output, lse and (dq, dk, dv) of sum(out * g_out)."""

    def gradients(implementation):
        def loss(q, k, v):
            out = jax_flash.attention(q, k, v, implementation=implementation, **kw)
            return jnp.sum(out.astype(jnp.float32) * g_out)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    fwd = jax.jit(lambda q, k, v: jax_flash.attention(
        q, k, v, implementation=implementation, return_residual=True, **kw))
    poison_free_memory()
    try:
        out, lse = fwd(q, k, v)
    except ValueError as e:
        # The grid run with the Turing family forced (JAX_FLASH_KERNELS=sm75, as on a T4): a call it
        # does not take (bfloat16, a bias, head dims above 128) must say so with implementation="cuda",
        # and auto mode's results (cuDNN or the xla path) are checked instead.
        if implementation != "cuda" or os.environ.get(_plan.KERNELS_ENV) != "sm75" or "on Turing" not in str(e):
            raise
        return run(None, q, k, v, g_out, **kw)
    poison_free_memory()
    return out, lse, gradients_within_the_cap(implementation, gradients)


def families_for(dtype, h, **kw) -> tuple[str, ...]:
    """The kernel families a check runs: the best, the sm80 kernels alone, and (forced on this GPU)
    the Turing ones where they take the call: float16 at head dims up to 128, no bias or mask. Or,
    where JAX_FLASH_KERNELS is set for the whole run, that family alone: the grid run as another
    GPU (sm80 under a shared-memory cap, JAX_FLASH_SMEM_LIMIT; or sm75, as on a T4)."""
    if forced := os.environ.get(_plan.KERNELS_ENV):
        return (forced,)
    return ("best", "sm80") + (("sm75",) if turing_takes(dtype, h, **kw) else ())


def turing_takes(dtype, h, **kw) -> bool:
    """Whether the Turing family runs the call: float16 at head dims up to 128, no bias or mask."""
    return dtype == jnp.float16 and h <= 128 and kw.get("bias") is None and kw.get("mask") is None


def forced_family() -> str:
    """The family the whole run forces (JAX_FLASH_KERNELS: the grid run as another GPU), else "best"."""
    return os.environ.get(_plan.KERNELS_ENV) or "best"


def turing_dtype(family: str, dtype=jnp.bfloat16):
    """float16 for the Turing family (it takes no bf16), else `dtype`."""
    return jnp.float16 if family == "sm75" else dtype


# The dtype of the tests that call the kernels directly: bfloat16, or float16 where the whole run is
# the Turing family's (JAX_FLASH_KERNELS=sm75), which takes no bfloat16.
KERNEL_DTYPE = turing_dtype(os.environ.get(_plan.KERNELS_ENV, ""))


def check(dtype, b, t, s, n, kv_heads, h, key_growth=1.0, families=None, **kw):
    """Each kernel family of `families` (by default `families_for`) against the float64 reference
    and the xla path; returns the inputs and the first family's results. key_growth: the first key is
    scaled by 1, the last by it, linearly in between (the sm90 forward visits the keys first to
    last, so each key block raises the rows' maxima)."""
    # The grid run as a T4 (JAX_FLASH_KERNELS=sm75): its kernels in float16 on the same shapes.
    dtype = turing_dtype(os.environ.get(_plan.KERNELS_ENV, ""), dtype)
    rng = rng_for("cuda", dtype, b, t, s, n, kv_heads, h, key_growth, tuple(sorted(kw.items())))
    q, k, v = qkv(rng, dtype, b, t, s, n, kv_heads, h)
    if key_growth != 1.0:
        growth = jnp.linspace(1.0, key_growth, s)[None, :, None, None]
        k = (k.astype(jnp.float32) * growth).astype(dtype)
    g_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    xla = run("xla", q, k, v, g_out, **kw)

    def ref_loss(q, k, v):
        return jnp.sum(reference.attention(q, k, v, **kw)[0] * g_out)

    ref_out, ref_lse = reference.attention(q, k, v, **kw)
    ref_grads = jax.grad(ref_loss, argnums=(0, 1, 2))(q, k, v)
    results = {}
    families = families or families_for(dtype, h, **kw)
    for family in families:
        with pytest.MonkeyPatch.context() as env:  # traces inside use these kernels
            env.setenv(_plan.KERNELS_ENV, family)
            ours = results[family] = run("cuda", q, k, v, g_out, **kw)
        checks = [("out", FWD_TOL, ours[0], xla[0], ref_out), ("lse", 1e-4, ours[1], xla[1], ref_lse)]
        checks += [(f"d{name}", GRAD_TOL, g, gx, gr) for name, g, gx, gr in zip("qkv", ours[2], xla[2], ref_grads)]
        # Where forced Turing kernels refuse the call (run() checked why), auto mode's results (cuDNN
        # or the xla path) are held to the xla path's error alone.
        ours_ran = family != "sm75" or turing_takes(dtype, h, **kw)
        for name, bound, mine, xla_value, ref in checks:
            err, xla_err = reference.rel_error(mine, ref), reference.rel_error(xla_value, ref)
            assert err < bound or not ours_ran, f"{family} {name}: {err:.2e} >= {bound} (xla path {xla_err:.2e})"
            factor = XLA_ERROR_FACTOR if key_growth == 1.0 else STEEP_XLA_ERROR_FACTOR
            assert err <= factor * xla_err + 1e-3, f"{family} {name}: {err:.2e} vs xla path {xla_err:.2e}"
        assert ours[0].dtype == dtype and ours[1].dtype == jnp.float32
    return (q, k, v, g_out), results[families[0]]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("h", [32, 64, 96, 128, 192, 256, 80])
@pytest.mark.parametrize("is_causal", [False, True])
def test_head_dims_and_dtypes(dtype, h, is_causal):
    check(dtype, 2, 129, 300, 4, 2, h, is_causal=is_causal)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("h", [192, 256])
@pytest.mark.parametrize("kw", [dict(local_window_size=(100, 30)), dict(is_causal=True, local_window_size=(64, 0))])
def test_wgmma_backward_at_192_and_256_with_bands(dtype, h, kw):
    """The d = 192 and 256 wgmma backward (cuda/sm90/bwd_wide_kernel.cuh for dK and dV,
    bwd_dq_kernel.cuh for dQ) with GQA, T != S, tails and bands (the band mask of their plain
    variants; the masked variants, lengths and segments, are in test_cuda_masks.py)."""
    check(dtype, 2, 129, 300, 4, 2, h, **kw)


@pytest.mark.parametrize("family,h", [(family, h) for family in ("best", "sm80", "sm75") for h in (64, 128, 192, 256)
                                      if family != "sm75" or h <= 128])  # fmt: skip
def test_gradients_through_the_lse(monkeypatch, family, h):
    """A loss of the output and of the returned lse: the lse's cotangent enters the backward
    (delta = rowsum(dO * O) - dlse); without it the kernels read none (an empty operand)."""
    monkeypatch.setenv(_plan.KERNELS_ENV, family)
    rng = rng_for("lse-cotangent", family, h)
    q, k, v = qkv(rng, turing_dtype(family), 2, 200, 300, 4, 2, h)
    g_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    g_lse = jnp.asarray(rng.normal(size=(2, 200, 4)), jnp.float32)

    def loss(attention):
        def f(q, k, v):
            out, lse = attention(q, k, v)
            return jnp.sum(out.astype(jnp.float32) * g_out) + jnp.sum(lse * g_lse)
        return f

    def grads(implementation):
        return jax.jit(jax.grad(loss(lambda q, k, v: jax_flash.attention(
            q, k, v, is_causal=True, implementation=implementation, return_residual=True)), argnums=(0, 1, 2)))(q, k, v)

    ours = gradients_within_the_cap("cuda", grads)
    ref = jax.grad(loss(lambda q, k, v: reference.attention(q, k, v, is_causal=True)), argnums=(0, 1, 2))(q, k, v)
    for name, mine, expected in zip("qkv", ours, ref):
        assert reference.rel_error(mine, expected) < GRAD_TOL, name


@pytest.mark.parametrize("t,s", [(1, 1), (7, 7), (129, 129), (1000, 1000), (4097, 4097),
                                 (1, 4097), (4097, 129), (7, 1000)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_lengths(t, s, is_causal):
    check(jnp.bfloat16, 1, t, s, 2, 1, 128, is_causal=is_causal)


@pytest.mark.parametrize("t,s", [(8192, 8192), (8200, 9000), (9000, 8200)])
def test_long_causal_rows_at_64(t, s):
    """d = 64 causal rows of 8192 queries and more take the 192-row tiles (run_sm90.cuh), with
    tails and T != S; shorter ones take 128-row tiles (the tests above)."""
    check(jnp.bfloat16, 1, t, s, 2, 1, 64, is_causal=True)


@pytest.mark.parametrize("h", [64, 128, 256])
@pytest.mark.parametrize("is_causal", [False, True])
def test_row_maxima_growing_across_key_blocks(h, is_causal):
    """The sm90 forward visits key blocks first to last and keeps a row's old maximum until a
    block exceeds it by 8 in exp2 units (lazy rescale, fwd_kernel.cuh): keys growing towards the
    end of the row raise the maxima by a few units a block, so that some blocks keep the old
    maximum and others rescale O."""
    check(jnp.bfloat16, 1, 1000, 1000, 2, 2, h, key_growth=8.0, is_causal=is_causal)


@pytest.mark.parametrize("dtype,h", [(jnp.bfloat16, 64), (jnp.bfloat16, 128), (jnp.float16, 128), (jnp.bfloat16, 256)])
@pytest.mark.parametrize("key_growth", [40.0, 300.0])
@pytest.mark.parametrize("is_causal", [False, True])
def test_logits_far_above_those_seen_before(dtype, h, key_growth, is_causal):
    """After a tile's first key block, the sm90 forward's softmax takes exp2 against each row's
    maximum so far (speculative, fwd_kernel.cuh). Keys growing steeply towards the end of the
    row (visited last) exceed it block after block: by far more than 2^8 at 40 (the warp takes the
    block's maxima and scales it down; some rows past 2^120), past 2^120 at 300 (the tile is
    listed, and the redo pass computes it again exactly)."""
    check(dtype, 1, 1000, 1000, 2, 2, h, key_growth=key_growth, is_causal=is_causal)


@pytest.mark.parametrize("n,kv_heads", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, (64, 0), (100, 30)])
def test_gqa_and_windows(n, kv_heads, window):
    check(jnp.bfloat16, 2, 500, 700, n, kv_heads, 64, local_window_size=window)


@pytest.mark.parametrize("window", [None, (64, 0), (100, 30)])
def test_windows_at_128(window):
    """H = 128 with bands, T != S and GQA: the sm80 forward's 128-row tiles (config.cuh) and, without
    a band, the sm90 backward's 80-query steps (run_sm90.cuh)."""
    check(jnp.bfloat16, 2, 500, 700, 4, 2, 128, local_window_size=window)


def test_repeatable_forward_and_dk_dv():
    """Same inputs twice: bit-identical output, lse, dK and dV (a moving result is a race)."""
    inputs, first = check(jnp.bfloat16, 2, 1000, 1000, 4, 2, 128, is_causal=True)
    for _ in range(3):
        again = run("cuda", *inputs, is_causal=True)
        np.testing.assert_array_equal(again[0], first[0])
        np.testing.assert_array_equal(again[1], first[1])
        np.testing.assert_array_equal(again[2][1], first[2][1])
        np.testing.assert_array_equal(again[2][2], first[2][2])


_DETERMINISTIC_CASES = [(128, dict(is_causal=True)), (64, dict(local_window_size=(300, 100))),
                        (128, dict(local_window_size=(200, 0))), (256, dict(is_causal=True))]
# The Turing family up to 128, and at 96 too (its 64-key CTAs and 32-query steps there).
_TURING_DETERMINISTIC_CASES = [(h, kw) for h, kw in _DETERMINISTIC_CASES if h <= 128] + [(96, dict(is_causal=True))]


@pytest.mark.parametrize("family,h,kw", [(f, h, kw) for f in ("best", "sm80") for h, kw in _DETERMINISTIC_CASES]
                         + [("sm75", h, kw) for h, kw in _TURING_DETERMINISTIC_CASES])  # fmt: skip
def test_deterministic_mode_gives_identical_gradients(monkeypatch, family, h, kw):
    """JAX_FLASH_DETERMINISTIC=1: five backward runs are bit-identical (GQA, tails, bands whose
    key blocks start at different query blocks) and still match the float64 reference. The
    Turing family's 32-query steps take one turn counter each (contract: DQ_COUNTER_ROWS)."""
    monkeypatch.setenv(_plan.KERNELS_ENV, family)
    monkeypatch.setenv(_ffi.DETERMINISTIC_ENV, "1")
    rng = rng_for("deterministic", family, h, tuple(sorted(kw.items())))
    q, k, v = qkv(rng, turing_dtype(family), 2, 1500, 1300, 8, 2, h)
    g_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
        jax_flash.attention(q, k, v, implementation="cuda", **kw).astype(jnp.float32) * g_out), argnums=(0, 1, 2)))
    runs = []
    for _ in range(5):
        poison_free_memory()
        try:
            runs.append(jax.block_until_ready(grad(q, k, v)))
        except ValueError as e:  # no backward kernel under this cap: the refusal is what is checked
            if not beyond_the_cap(e):
                raise
            return
    for again in runs[1:]:
        for name, a, b in zip("qkv", runs[0], again):
            np.testing.assert_array_equal(a, b, err_msg=f"d{name} moved between runs")
    ref = jax.grad(lambda q, k, v: jnp.sum(reference.attention(q, k, v, **kw)[0] * g_out), argnums=(0, 1, 2))(q, k, v)
    for name, mine, expected in zip("qkv", runs[0], ref):
        assert reference.rel_error(mine, expected) < GRAD_TOL, f"d{name}"


def _custom_call_targets(fn, *args):
    return jax.jit(fn).lower(*args).as_text()


def test_auto_mode_uses_the_kernels():
    q, k, v = qkv(rng_for("auto"), KERNEL_DTYPE, 1, 256, 256, 2, 2, 64)
    fwd_text = _custom_call_targets(lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True), q, k, v)
    grad_text = _custom_call_targets(
        jax.grad(lambda q, k, v: jax_flash.attention(q, k, v).astype(jnp.float32).sum()), q, k, v)
    assert "jax_flash_fwd" in fwd_text
    assert "jax_flash_bwd" in grad_text
    # float32 is not a kernel dtype: auto mode takes the xla path.
    q32 = q.astype(jnp.float32)
    assert "jax_flash_fwd" not in _custom_call_targets(lambda q: jax_flash.attention(q, q, q), q32)


def test_cuda_raises_on_what_it_cannot_run():
    q, k, v = qkv(rng_for("raise"), jnp.float32, 1, 16, 16, 2, 2, 64)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        jax_flash.attention(q, k, v, implementation="cuda")
    # Under the Turing family, head dims above 128 are refused first.
    widest = "up to 128, got 1088" if KERNEL_DTYPE == jnp.float16 else "1088 is above the largest supported"
    with pytest.raises(ValueError, match=f"head dims? {widest}"):
        q = jnp.zeros((1, 16, 2, 1088), KERNEL_DTYPE)
        jax_flash.attention(q, q, q, implementation="cuda")


def test_vmap_and_checkpointed_scan():
    rng = rng_for("transforms")
    q, k, v = qkv(rng, KERNEL_DTYPE, 4, 256, 256, 2, 2, 64)
    stacked = [x.reshape(2, 2, *x.shape[1:]) for x in (q, k, v)]
    f = lambda q, k, v, **kw: jax_flash.attention(q, k, v, implementation="cuda", **kw)  # noqa: E731
    batched = jax.jit(jax.vmap(lambda q, k, v: f(q, k, v, is_causal=True)))(*stacked).reshape(q.shape)
    assert reference.rel_error(batched, reference.attention(q, k, v, is_causal=True)[0]) < FWD_TOL

    # vmap over the queries only (one kernel call, the mapped axis folded into the heads) and its
    # gradients, against the per-element loop of the xla path.
    g = lambda impl: jax.jit(jax.vmap(jax.grad(  # noqa: E731
        lambda q, k, v: jax_flash.attention(q, k, v, implementation=impl).astype(jnp.float32).sum(),
        argnums=(0, 1, 2)), in_axes=(0, None, None)))
    ours, xla = g("cuda")(stacked[0], k[:2], v[:2]), g("xla")(stacked[0], k[:2], v[:2])
    for mine, theirs in zip(ours, xla):
        assert reference.rel_error(mine, theirs) < GRAD_TOL

    weights = jnp.asarray(rng.normal(size=(3, 64, 64)) / 8, KERNEL_DTYPE)

    def model(x, weights, attn):
        def body(x, w):
            y = (x @ w).astype(x.dtype)
            return x + attn(y, y, y, is_causal=True).astype(x.dtype), None
        return jax.lax.scan(jax.checkpoint(body), x, weights)[0].astype(jnp.float32).sum()

    ours = jax.jit(jax.grad(model, argnums=1), static_argnums=2)(q, weights, f)
    xla = jax.jit(jax.grad(model, argnums=1), static_argnums=2)(
        q, weights, lambda q, k, v, **kw: jax_flash.attention(q, k, v, implementation="xla", **kw))
    assert reference.rel_error(ours, xla) < GRAD_TOL


def test_long_sequence_one_head():
    """Memory stays O(seqlen): 131072 tokens, one head, forward and backward."""
    q, k, v = qkv(rng_for("long"), KERNEL_DTYPE, 1, 131072, 131072, 1, 1, 128)

    def loss(q, k, v):
        return jax_flash.attention(q, k, v, is_causal=True, implementation="cuda").astype(jnp.float32).sum()

    out = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True))(q, k, v)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert not jnp.isnan(out.astype(jnp.float32)).any()
    assert all(not jnp.isnan(g.astype(jnp.float32)).any() for g in grads)
    # The last query sees every key: its output is the mean of V weighted by softmax.
    tail = reference.attention(q[:, -1:], k, v, is_causal=True)[0]
    assert reference.rel_error(out[:, -1:], tail) < FWD_TOL
