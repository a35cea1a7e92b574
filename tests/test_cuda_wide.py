"""Head dims above 256 on the forward kernels (sm90/wide_fwd_kernel.cuh, and sm80/wide_fwd_kernel.cuh
forced; marked `gpu`): the forward against the float64 reference and the xla path, with every
mask but a bias and a mask over both queries and keys; the gradients of auto mode (the xla path's
backward on the kernel's residuals) against float64, and implementation="cuda" refusing to
differentiate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ffi, _plan, cuda_impl
from tests import reference
from tests.cases import rng_for
from tests.test_cuda import FWD_TOL, GRAD_TOL, poison_free_memory

pytestmark = pytest.mark.gpu


def hopper_or_skip(kernel: str = "the forward above head dim 256"):
    """Skips where the dispatch's rule says Hopper's kernels do not run: another GPU, no sm_90a code,
    or a run that forces another kernel family (the grid run as an sm_86 or a T4: GRID in
    scripts/gpu_check.sh)."""
    if _plan.family() is not _plan.Family.HOPPER:
        pytest.skip(f"{kernel} runs on Hopper's kernels alone (a 9.0 GPU, sm_90a code, {_plan.KERNELS_ENV} not "
                    "forcing another family)")


def _sm80_wide_forward_fits(h: int) -> bool:
    """Whether the mma.sync forward at head dim h fits the GPU's (or JAX_FLASH_SMEM_LIMIT's) cap."""
    padded = _plan.kernel_head_dim(h, cuda_impl.SM80_WIDE_FWD_HEAD_DIMS)
    return _ffi.extension().sm80_wide_forward_smem_bytes(padded) <= _ffi.smem_limit()


MASKS = {
    "none": lambda b, t, s, rng: {},
    "causal": lambda b, t, s, rng: {"is_causal": True},
    "window": lambda b, t, s, rng: {"local_window_size": (90, 20)},
    "lengths_causal": lambda b, t, s, rng: {
        "is_causal": True, "query_seq_lengths": jnp.asarray([t, t // 2 + 3], jnp.int32),
        "key_value_seq_lengths": jnp.asarray([s, s // 3 + 1], jnp.int32)},
    "segments": lambda b, t, s, rng: dict(zip(("q_segment_ids", "kv_segment_ids"), (
        jnp.asarray(np.sort(rng.integers(0, 3, size=(b, n))), jnp.int32) for n in (t, s)))),
    "softcap_causal": lambda b, t, s, rng: {"softcap": 20.0, "is_causal": True},
    # A mask along one axis runs as segment ids (cuda_impl.mask_as_segments).
    "padding_mask": lambda b, t, s, rng: {"mask": jnp.asarray(rng.random((b, 1, 1, s)) > 0.3)},
}  # fmt: skip


# (kernel family, head dim): above 512 Hopper's pairs alone, at 640, 768, 896 and 1024 (576, 704
# and 1000 zero-padded up); the mma.sync family's refusal there is tests/test_cuda_path_on_cpu.py's.
FAMILY_HEAD_DIMS = [(family, h) for family in ("best", "sm80") for h in (300, 320, 384, 448, 512, 576, 704, 896, 1000)
                    if family == "best" or h <= 512]  # fmt: skip


@pytest.mark.parametrize("family,h", FAMILY_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_forward(monkeypatch, family, dtype, h, mask):
    """T != S and both not multiples of 64 (tails in both), GQA 4 over 2; Hopper's kernel (best)
    and the mma.sync one (sm80/wide_fwd_kernel.cuh, forced)."""
    if family == "best":
        hopper_or_skip()
    monkeypatch.setenv(_plan.KERNELS_ENV, family)
    rng = rng_for("cuda-wide", dtype, h, mask)
    b, t, s = 2, 200, 300 if mask != "segments" else 200
    q = jnp.asarray(rng.normal(size=(b, t, 4, h)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(b, s, 2, h)), dtype) for _ in range(2))
    kw = MASKS[mask](b, t, s, rng)
    attend = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, implementation="cuda", return_residual=True, **kw))
    if family == "sm80" and not _sm80_wide_forward_fits(h):  # under a shared-memory cap: refused, auto mode's
        with pytest.raises(ValueError, match="bytes of shared memory a block"):
            attend.lower(q, k, v)
        attend = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, return_residual=True, **kw))
    else:
        assert "jax_flash_fwd" in attend.lower(q, k, v).as_text()
    poison_free_memory()
    out, lse = attend(q, k, v)
    xla_out, xla_lse = jax_flash.attention(q, k, v, implementation="xla", return_residual=True, **kw)
    ref_out, ref_lse = reference.attention(q, k, v, **kw)
    assert out.dtype == dtype and out.shape == q.shape
    err, xla_err = reference.rel_error(out, ref_out), reference.rel_error(xla_out, ref_out)
    assert err < FWD_TOL and err <= 2 * xla_err + 1e-3, (err, xla_err)
    finite = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    assert reference.rel_error(jnp.where(finite, lse, 0), jnp.where(finite, ref_lse, 0)) < 1e-4


@pytest.mark.parametrize("h", [320, 512, 1000])
def test_gradients_take_the_xla_backward(h):
    """Auto mode: the kernel's forward, the xla path's backward on its output and lse; strict mode
    says it has no backward kernels there."""
    hopper_or_skip()
    rng = rng_for("cuda-wide-grad", h)
    q = jnp.asarray(rng.normal(size=(1, 150, 4, h)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(1, 170, 1, h)), jnp.bfloat16) for _ in range(2))
    g_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * g_out)

    ours = lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True)  # noqa: E731
    grad = jax.jit(jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2)))
    text = grad.lower(q, k, v).as_text()
    assert "jax_flash_fwd" in text and "jax_flash_bwd" not in text
    grads = grad(q, k, v)
    ref = jax.grad(lambda *a: loss(lambda q, k, v: reference.attention(q, k, v, is_causal=True)[0], *a),
                   argnums=(0, 1, 2))(q, k, v)  # fmt: skip
    for mine, want in zip(grads, ref):
        assert reference.rel_error(mine, want) < GRAD_TOL
    strict = lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True, implementation="cuda")  # noqa: E731
    with pytest.raises(ValueError, match="no backward kernels above head dim 256"):
        jax.grad(lambda *a: loss(strict, *a))(q, k, v)


def test_a_bias_above_256_takes_the_xla_path():
    hopper_or_skip()
    q = k = v = jnp.ones((1, 64, 2, 320), jnp.bfloat16)
    bias = jnp.zeros((1, 2, 64, 64), jnp.float32)
    assert jax_flash.chosen_implementation(q, k, v, bias=bias) != "cuda"
    with pytest.raises(ValueError, match="without a bias"):
        jax_flash.attention(q, k, v, bias=bias, implementation="cuda")


def test_65536_tokens_at_512_forward_and_backward():
    """65 536 tokens at d = 512, 8 heads: jax.nn's xla path would form 137 GB of float32 scores;
    ours runs the kernel forward and the backward in budget-sized blocks. Query i's output and dQ
    depend only on its own row, so 64 sampled rows are checked against float64 on those rows."""
    hopper_or_skip()
    rng = rng_for("cuda-wide-65536")
    b, s, n, h = 1, 65536, 8, 512
    q, k, v, g_out = (jnp.asarray(rng.normal(size=(b, s, n, h)), jnp.bfloat16) for _ in range(4))
    rows = jnp.asarray(np.sort(rng.choice(s, 64, replace=False)))

    def loss(attend, q, k, v, g_out):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * g_out.astype(jnp.float32))

    (out, (dq, dk, dv)) = jax.jit(lambda q, k, v: (jax_flash.attention(q, k, v), jax.grad(
        lambda *a: loss(jax_flash.attention, *a, g_out), argnums=(0, 1, 2))(q, k, v)))(q, k, v)  # fmt: skip
    assert all(bool(jnp.isfinite(x).all()) for x in (out, dq, dk, dv))
    ref_out = reference.attention(q[:, rows], k, v)[0]
    ref_dq = jax.grad(lambda q: loss(lambda q, k, v: reference.attention(q, k, v)[0], q, k, v, g_out[:, rows]))(q[:, rows])
    assert reference.rel_error(out[:, rows], ref_out) < FWD_TOL
    assert reference.rel_error(dq[:, rows], ref_dq) < GRAD_TOL
