"""`jax_flash.paged_attention` on CPU: each sequence's pages, scattered through a shared pool in
shuffled order, give what the float64 reference gives on the same tokens laid out densely; page
sizes 16-256, 1-16 queries, GQA, lengths not multiples of a page (0 and 1 included), windows and
the soft cap; page indices out of the pool are clamped; bad arguments raise by name. The CUDA path
is the same gather feeding the kernels (test_cuda*.py test those)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from tests import fake_kernels, reference
from tests.cases import rng_for


def paged_problem(rng, b, t, n, kv_heads, h, page_size, max_pages, lengths, spare_pages=3):
    """Queries, a pool with every sequence's pages at shuffled places (and spare pages of noise),
    the page table, and each sequence's tokens laid out densely [B, max_pages * page_size, K, H]."""
    pool = b * max_pages + spare_pages
    key_pages = rng.normal(size=(pool, page_size, kv_heads, h))
    value_pages = rng.normal(size=(pool, page_size, kv_heads, h))
    page_indices = rng.permutation(pool)[: b * max_pages].reshape(b, max_pages)
    dense_k = key_pages[page_indices].reshape(b, max_pages * page_size, kv_heads, h)
    dense_v = value_pages[page_indices].reshape(b, max_pages * page_size, kv_heads, h)
    q = rng.normal(size=(b, t, n, h))
    as_bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    return (as_bf16(q), as_bf16(key_pages), as_bf16(value_pages), jnp.asarray(lengths, jnp.int32),
            jnp.asarray(page_indices, jnp.int32), as_bf16(dense_k), as_bf16(dense_v))  # fmt: skip


def check(page_size, t, n, kv_heads, lengths, implementation="xla", **kw):
    rng = rng_for("paged", page_size, t, n, kv_heads, tuple(lengths), tuple(sorted(kw.items())))
    b, h = len(lengths), 32
    max_pages = max(1, -(-max(lengths) // page_size))
    q, kp, vp, lens, table, dense_k, dense_v = paged_problem(rng, b, t, n, kv_heads, h, page_size, max_pages, lengths)
    out, lse = jax_flash.paged_attention(q, kp, vp, lens, table, return_residual=True, implementation=implementation,
                                         **kw)  # fmt: skip
    ref_out, ref_lse = reference.attention(q, dense_k, dense_v, key_value_seq_lengths=lens,
                                           query_seq_lengths=jnp.full((b,), t), **kw)  # fmt: skip
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3]
    assert reference.rel_error(out, ref_out) < 1e-2
    assert reference.rel_error(lse, ref_lse) < 1e-4
    return out


@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("t", [1, 4, 16])
def test_page_sizes_and_query_counts(page_size, t):
    check(page_size, t, 8, 2, [3 * page_size + 5, page_size, 17], is_causal=True)


@pytest.mark.parametrize("n,kv_heads", [(4, 4), (8, 1), (16, 2)])
def test_gqa_and_mqa(n, kv_heads):
    check(16, 2, n, kv_heads, [40, 23, 64], is_causal=True)


def test_lengths_zero_one_and_shorter_than_the_queries():
    """A sequence with no tokens gives 0 (lse -inf); with fewer tokens than queries the first
    queries (before position 0) see nothing under the causal mask."""
    out = check(16, 4, 4, 2, [0, 1, 2, 37], is_causal=True)
    assert not np.asarray(out[0], np.float32).any() and not np.asarray(out[1, :3], np.float32).any()


@pytest.mark.parametrize("kw", [dict(local_window_size=(20, 0)), dict(softcap=5.0, is_causal=True),
                                dict(is_causal=False)], ids=["window", "softcap", "not-causal"])
def test_windows_soft_cap_and_no_mask(kw):
    check(32, 3, 4, 2, [70, 33], **kw)


def test_the_cuda_path_through_the_stand_in(monkeypatch):
    fake_kernels.install(monkeypatch)
    check(16, 4, 8, 2, [50, 16, 3], implementation="cuda", is_causal=True)


def test_pages_past_the_length_and_outside_the_pool_are_never_read(monkeypatch):
    """Table entries past a sequence's pages (here huge and negative) do not change its output;
    inside its pages an index outside the pool is clamped, and the call stays finite."""
    rng = rng_for("paged-bounds")
    q, kp, vp, lens, table, _, _ = paged_problem(rng, 2, 2, 4, 2, 32, 16, 4, [20, 64])
    out = jax_flash.paged_attention(q, kp, vp, lens, table, is_causal=True)
    junk = table.at[0, 2:].set(jnp.asarray([10**6, -(10**6)], jnp.int32))  # sequence 0 uses 2 pages
    np.testing.assert_array_equal(jax_flash.paged_attention(q, kp, vp, lens, junk, is_causal=True), out)
    clamped = table.at[1, 1].set(10**6)
    expected_table = table.at[1, 1].set(kp.shape[0] - 1)
    np.testing.assert_array_equal(jax_flash.paged_attention(q, kp, vp, lens, clamped, is_causal=True),
                                  jax_flash.paged_attention(q, kp, vp, lens, expected_table, is_causal=True))


def test_jit_with_the_pool_donated():
    """A decode step as a model writes it: the new token's K/V set into the pool inside jit, the
    pool donated (updated in place), then the attention."""
    rng = rng_for("paged-step")
    q, kp, vp, lens, table, _, _ = paged_problem(rng, 2, 1, 4, 2, 32, 16, 3, [10, 30])
    k_new = jnp.asarray(rng.normal(size=(2, 2, 32)), jnp.bfloat16)

    @jax.jit
    def step(kp, vp, q, k_new, lens):
        page, slot = table[jnp.arange(2), (lens - 1) // 16], (lens - 1) % 16
        kp, vp = kp.at[page, slot].set(k_new), vp.at[page, slot].set(k_new)
        return jax_flash.paged_attention(q, kp, vp, lens, table, is_causal=True), kp, vp

    donating = jax.jit(step.__wrapped__, donate_argnums=(0, 1))
    expected = step(kp, vp, q, k_new, lens)[0]
    out, kp2, _ = donating(jnp.array(kp), jnp.array(vp), q, k_new, lens)
    np.testing.assert_array_equal(out, expected)
    assert np.array_equal(np.asarray(kp2[table[1, 29 // 16], 29 % 16], np.float32), np.asarray(k_new[1], np.float32))


@pytest.mark.parametrize("change,error,name", [
    (dict(query=jnp.zeros((2, 1, 4))), ValueError, "query must have shape"),
    (dict(key_pages=jnp.zeros((5, 16, 2, 32), jnp.float32)), TypeError, "key_pages"),
    (dict(value_pages=jnp.zeros((5, 8, 2, 32), jnp.bfloat16)), ValueError, "value_pages shape"),
    (dict(lengths=jnp.zeros((3,), jnp.int32)), ValueError, "lengths"),
    (dict(lengths=jnp.zeros((2,), jnp.float32)), TypeError, "lengths"),
    (dict(page_indices=jnp.zeros((2,), jnp.int32)), ValueError, "page_indices"),
    (dict(page_indices=jnp.zeros((2, 3), jnp.float32)), TypeError, "page_indices"),
    (dict(key_pages=jnp.zeros((5, 16, 3, 32), jnp.bfloat16), value_pages=jnp.zeros((5, 16, 3, 32), jnp.bfloat16)),
     ValueError, "multiple of the kv heads"),
])  # fmt: skip
def test_bad_arguments_raise_by_name(change, error, name):
    args = dict(query=jnp.zeros((2, 1, 4, 32), jnp.bfloat16), key_pages=jnp.zeros((5, 16, 2, 32), jnp.bfloat16),
                value_pages=jnp.zeros((5, 16, 2, 32), jnp.bfloat16), lengths=jnp.ones((2,), jnp.int32),
                page_indices=jnp.zeros((2, 3), jnp.int32))  # fmt: skip
    args.update(change)
    with pytest.raises(error, match=name):
        jax_flash.paged_attention(**args)
