"""The split-KV decode kernels (cuda/decode/) on a GPU, against the float64 reference: every head
dim, 1-16 queries, GQA groups 1-16, lengths 0, 1 and not multiples of any block, windows, the
soft cap, one and many splits, dense caches and pools of shuffled pages of each size. Outputs land
on NaN-poisoned memory; each call runs twice and must give the same bits (a race would move)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _decode, _plan
from tests import reference
from tests.cases import qkv, rng_for
from tests.test_cuda import poison_free_memory
from tests.test_paged import paged_problem

pytestmark = pytest.mark.gpu

TOL = 1e-2  # bf16/fp16 relative error against float64


@pytest.fixture(autouse=True)
def decode_kernels_or_skip():
    """The Turing family has no decode kernels: its forward runs decode shapes (test_lengths of
    tests/test_cuda.py in a grid run forced to it, and tests/test_turing_dispatch.py the choice)."""
    if _plan.family() is _plan.Family.TURING:
        pytest.skip("the Turing kernels (on sm_75, or forced with JAX_FLASH_KERNELS=sm75) have no decode kernels")


def _decode_call(q, k, v, lengths, **kw):
    """jax_flash.attention on a dense cache, jitted anew (the split count is read when traced);
    checks that the decode kernels run it."""
    fn = lambda q, k, v, lengths: jax_flash.attention(  # noqa: E731
        q, k, v, key_value_seq_lengths=lengths, implementation="cuda", return_residual=True, **kw)
    assert "jax_flash_decode" in jax.jit(fn).lower(q, k, v, lengths).as_text()
    results = []
    for _ in range(2):
        poison_free_memory()
        results.append(jax.jit(fn)(q, k, v, lengths))
    for a, b in zip(*results):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    return results[0]


def check(dtype, b, t, s, n, kv_heads, h, lengths, **kw):
    rng = rng_for("cuda-decode", dtype, b, t, s, n, kv_heads, h, tuple(lengths), tuple(sorted(kw.items())))
    q, k, v = qkv(rng, dtype, b, t, s, n, kv_heads, h)
    lengths = jnp.asarray(lengths, jnp.int32)
    out, lse = _decode_call(q, k, v, lengths, **kw)
    ref_out, ref_lse = reference.attention(q, k, v, key_value_seq_lengths=lengths, **kw)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert reference.rel_error(out, ref_out) < TOL
    finite = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)  # -inf exactly where empty
    assert reference.rel_error(jnp.where(finite, lse, 0), jnp.where(finite, ref_lse, 0)) < 1e-4
    return out, lse


@pytest.mark.parametrize("h", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_head_dims(dtype, h):
    check(dtype, 3, 1, 777, 8, 2, h, [777, 300, 45], is_causal=True)


@pytest.mark.parametrize("t", [1, 2, 4, 7, 16])
@pytest.mark.parametrize("n,kv_heads", [(4, 4), (32, 8), (16, 1), (32, 2)])
def test_queries_and_groups(t, n, kv_heads):
    """Groups 1, 4, 16 (one 16-row tile at T = 1) and 16 x 16 = 256 packed rows (16 tiles)."""
    check(jnp.bfloat16, 2, t, 530, n, kv_heads, 128, [530, 97], is_causal=True)


@pytest.mark.parametrize("lengths", [[0, 1, 2, 17], [16, 15, 33, 1000]])
def test_lengths_empty_single_and_ragged(lengths):
    """Length 0: output 0 and lse -inf; with fewer keys than queries the first queries see nothing."""
    out, lse = check(jnp.bfloat16, 4, 4, 1000, 8, 2, 64, lengths, is_causal=True)
    if lengths[0] == 0:
        assert not np.asarray(out[0], np.float32).any() and np.isneginf(np.asarray(lse[0])).all()


@pytest.mark.parametrize("kw", [dict(local_window_size=(100, 0)), dict(local_window_size=(37, 3)),
                                dict(softcap=8.0, is_causal=True), dict(is_causal=False),
                                dict(softcap=5.0, local_window_size=(200, 0), scale=0.3)],
                         ids=["window", "window-right", "softcap", "not-causal", "everything"])  # fmt: skip
def test_windows_and_soft_cap(kw):
    check(jnp.bfloat16, 2, 4, 1500, 16, 4, 128, [1500, 811], **kw)


@pytest.mark.parametrize("splits", ["1", "3", "128"])
def test_forced_split_counts(splits, monkeypatch):
    """One split (no combine), a few, and the most (many of them empty)."""
    monkeypatch.setenv(_decode.SPLITS_ENV, splits)
    check(jnp.bfloat16, 2, 2, 2000, 16, 2, 128, [2000, 700], is_causal=True)


@pytest.mark.parametrize("h", [64, 128, 256])
def test_grids_past_two_ctas_an_sm(h):
    """More CTAs than two an SM hold (40 x 8 kv heads, one split each, > 264 on an H100): up to
    H = 128 the configuration launched one CTA an SM (run_decode.cuh), with ragged lengths and a
    length 0."""
    lengths = [(301 * i) % 1200 for i in range(40)]
    check(jnp.bfloat16, 40, 1, 1200, 32, 8, h, lengths, is_causal=True)


def test_long_cache_at_batch_one():
    """128k keys in 15 splits (the rule on an H100), four query heads to each kv head."""
    check(jnp.bfloat16, 1, 1, 131072, 32, 8, 128, [131072], is_causal=True)


def test_gradients_of_a_decode_call():
    rng = rng_for("cuda-decode-grad")
    q, k, v = qkv(rng, jnp.bfloat16, 2, 3, 400, 8, 2, 64)
    lengths = jnp.asarray([400, 123], jnp.int32)
    g = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * g)

    ours = jax.jit(jax.grad(lambda *a: loss(lambda q, k, v: jax_flash.attention(
        q, k, v, key_value_seq_lengths=lengths, is_causal=True), *a), argnums=(0, 1, 2)))(q, k, v)  # fmt: skip
    ref = jax.grad(lambda *a: loss(lambda q, k, v: reference.attention(
        q, k, v, key_value_seq_lengths=lengths, is_causal=True)[0], *a), argnums=(0, 1, 2))(q, k, v)  # fmt: skip
    for g_ours, g_ref in zip(ours, ref):
        assert reference.rel_error(g_ours, g_ref) < 2e-2


@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("t", [1, 4])
def test_paged_in_place(page_size, t):
    """Shuffled pages of each size (with spare pages of noise in the pool), read in place."""
    rng = rng_for("cuda-decode-paged", page_size, t)
    lengths = [5 * page_size + 3, 1, page_size, 0]
    q, kp, vp, lens, table, dense_k, dense_v = paged_problem(rng, 4, t, 16, 4, 128, page_size, 6, lengths)
    fn = lambda *a: jax_flash.paged_attention(*a, is_causal=True, return_residual=True, implementation="cuda")  # noqa: E731
    assert "jax_flash_decode" in jax.jit(fn).lower(q, kp, vp, lens, table).as_text()
    poison_free_memory()
    out, lse = jax.jit(fn)(q, kp, vp, lens, table)
    ref_out, _ = reference.attention(q, dense_k, dense_v, key_value_seq_lengths=lens,
                                     query_seq_lengths=jnp.full((4,), t), is_causal=True)  # fmt: skip
    assert reference.rel_error(out, ref_out) < TOL
    dense_out = jax_flash.attention(q, dense_k, dense_v, key_value_seq_lengths=lens, is_causal=True)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(dense_out, np.float32))


_GRAPH_STEP = """
import jax, jax.numpy as jnp, jax_flash
q = jnp.ones((1, 1, 32, 128), jnp.bfloat16)
k = jax.random.normal(jax.random.key(0), (1, 1024, 8, 128), jnp.bfloat16)
@jax.jit
def step(q, k):
    for _ in range(4):  # as a model's layers: a fusion, then attention
        q = jax_flash.attention(q * 2, k, k, is_causal=True, key_value_seq_lengths=jnp.array([1000]),
                                implementation="cuda")
    return q
jax.block_until_ready(step(q, k))
"""


def test_a_jitted_decode_step_runs_as_one_cuda_graph(tmp_path):
    """The handlers are registered command-buffer compatible (_ffi.register_targets), so XLA puts a
    step's decode calls with its fusions into one command buffer (a CUDA graph) instead of
    launching each from the host: in the thunk sequence XLA dumps, no custom call is left at the
    top level."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path}", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    subprocess.run([sys.executable, "-c", _GRAPH_STEP], env=env, check=True, capture_output=True)
    (dump,) = [p for p in tmp_path.glob("*jit_step*thunk_sequence_after_thunk_passes.txt")]
    top_level = [line for line in dump.read_text().splitlines() if line[:1].isdigit()]
    assert any("kCommandBuffer" in line for line in top_level), top_level
    assert not any("kCustomCall" in line for line in top_level), top_level
    assert "kCustomCall" in dump.read_text()
