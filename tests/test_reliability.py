"""The inputs a new user found wrong results or bad errors with (2026-12-01), as standing tests.

Each path runs against float64: `jax.nn` where it takes the same call, else tests/reference.py.
`xla-dense` and `xla-blockwise` are the two forms of the xla path (the dense one within the
memory budget); `cuda-on-cpu` runs the CUDA path's Python through the fake kernels. The `gpu`
tests at the end run the same checks on the kernels of every family.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _plan, dense_impl, xla_impl
from jax_flash._validation import validate
from jax_flash.paged import gather_pages
from tests import fake_kernels, reference

PATHS = ("xla-dense", "xla-blockwise", "cuda-on-cpu")


class Path:
    """jax_flash.attention on one path: float32 in and out (the kernels' path in bfloat16), with
    the tolerance against float64 that its precision gives."""

    def __init__(self, name: str):
        self.name = name
        self.tol = 2e-2 if name == "cuda-on-cpu" else 2e-5

    def __call__(self, q, k, v, **kw):
        if self.name != "cuda-on-cpu":
            return jax_flash.attention(q, k, v, implementation="xla", **kw)
        result = jax_flash.attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), implementation="cuda", **kw)
        return jax.tree.map(lambda x: x.astype(jnp.float32), result)


@pytest.fixture(params=PATHS)
def run(request, monkeypatch):
    path = request.param
    if path == "cuda-on-cpu":
        fake_kernels.install(monkeypatch)
    else:
        monkeypatch.setattr(dense_impl, "budget_bytes", lambda: 2**40 if path == "xla-dense" else 0)
    return Path(path)


def _qkv(b, t, s, n=2, k=2, h=8, seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(key, shape, dtype) for key, shape in
                 zip(keys, ((b, t, n, h), (b, s, k, h), (b, s, k, h))))  # fmt: skip


def _close(x, ref, tol=2e-5):
    assert reference.rel_error(x, ref) < tol


# ---- 1. T == S aligns query i with key i, whatever lengths are given (as jax.nn) --------------


@pytest.mark.parametrize("lengths", [dict(key_value_seq_lengths=[7, 12]),
                                     dict(query_seq_lengths=[5, 12]),
                                     dict(query_seq_lengths=[12, 4], key_value_seq_lengths=[7, 9])])  # fmt: skip
@pytest.mark.parametrize("window", [None, 3])
def test_equal_lengths_align_as_jax_nn_with_any_lengths(run, lengths, window):
    q, k, v = _qkv(2, 12, 12)
    lengths = {name: jnp.asarray(x, jnp.int32) for name, x in lengths.items()}
    out = run(q, k, v, is_causal=True, local_window_size=window, **lengths)
    ref = jax.nn.dot_product_attention(q.astype(jnp.float64), k.astype(jnp.float64), v.astype(jnp.float64),
                                       is_causal=True, local_window_size=window, **lengths)  # fmt: skip
    # Rows that see a key; jax.nn leaves the others unspecified, we give 0.
    seen = reference.visibility(2, 2, 12, 12, is_causal=True, local_window_size=window, **lengths).any(-1)
    rows = seen.transpose(0, 2, 1)[..., None]
    _close(jnp.where(rows, out, 0), jnp.where(rows, ref, 0), run.tol)
    assert not np.asarray(jnp.where(rows, 0, out)).any()


def test_the_right_padded_batch_of_the_report(run):
    """(1, 12, 2, 8) holding 7 tokens: rows 0-4 came out 0."""
    q, k, v = _qkv(1, 12, 12)
    out = run(q, k, v, is_causal=True, key_value_seq_lengths=jnp.asarray([7]))
    alone = jax.nn.dot_product_attention(q[:, :7], k[:, :7], v[:, :7], is_causal=True)
    _close(out[:, :7], alone, run.tol)


def test_unequal_lengths_keep_the_last_query_on_the_last_key(run):
    """A decode step against a dense cache: T != S, the last query sees key lengths - 1."""
    q, k, v = _qkv(2, 3, 16)
    lengths = jnp.asarray([9, 16])
    out = run(q, k, v, is_causal=True, key_value_seq_lengths=lengths)
    ref, _ = reference.attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths, diagonal_by_lengths=True)
    _close(out, ref, run.tol)


def test_a_paged_cache_as_long_as_its_queries_keeps_them_last():
    """paged_attention's queries are the last T tokens also where T equals the gathered length."""
    q, pages, _ = _qkv(2, 8, 4 * 4, k=2)
    pages = pages.reshape(4 * 2, 4, 2, 8)
    table, lengths = jnp.asarray([[0, 1], [2, 3]]), jnp.asarray([5, 8])
    out = jax_flash.paged_attention(q, pages, pages, lengths, table, is_causal=True, implementation="xla")
    gathered = gather_pages(pages, table)
    ref, _ = reference.attention(q, gathered, gathered, is_causal=True, key_value_seq_lengths=lengths,
                                 diagonal_by_lengths=True)  # fmt: skip
    _close(out, ref)


# ---- 2. Ignored slots stay out of every output and gradient -----------------------------------


def _poisoned(x, lengths, value):
    """x [B, S, ...] with every slot at or past lengths[b] set to `value`."""
    past = jnp.arange(x.shape[1])[None, :] >= jnp.asarray(lengths)[:, None]
    return jnp.where(past.reshape(past.shape + (1,) * (x.ndim - 2)), jnp.asarray(value, x.dtype), x)


@pytest.mark.parametrize("poison", [jnp.nan, jnp.inf, -jnp.inf])
@pytest.mark.parametrize("causal", [False, True])
def test_values_past_the_key_lengths_reach_no_output_or_gradient(run, poison, causal):
    q, k, v = _qkv(2, 5, 13)
    lengths = jnp.asarray([6, 13])
    kw = dict(is_causal=causal, key_value_seq_lengths=lengths)

    def loss(q, k, v):
        out, lse = run(q, k, v, return_residual=True, **kw)
        return (out * jnp.cos(out)).sum() + jnp.where(jnp.isfinite(lse), lse, 0).sum()

    value_and_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))  # one compilation for both
    clean = value_and_grads(q, k, v)
    dirty = value_and_grads(q, _poisoned(k, lengths, poison), _poisoned(v, lengths, poison))
    for x, ref in zip(jax.tree.leaves(dirty), jax.tree.leaves(clean)):
        assert np.isfinite(np.asarray(x)).all()
        _close(x, ref, 1e-6)
    dk = np.asarray(dirty[1][1])
    assert not dk[0, 6:].any(), "ignored keys get zero gradient"


def test_query_rows_past_their_lengths_reach_no_gradient(run):
    q, k, v = _qkv(2, 9, 9)
    q_len = jnp.asarray([4, 9])
    kw = dict(query_seq_lengths=q_len, key_value_seq_lengths=jnp.asarray([9, 6]))
    loss = lambda q, k, v: run(q, k, v, **kw).sum()  # noqa: E731
    grads_of = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    grads = grads_of(_poisoned(q, q_len, jnp.nan), k, v)
    clean = grads_of(q, k, v)
    for x, ref in zip(grads, clean):
        _close(x, ref, 1e-6)


@pytest.mark.parametrize("implementation", ["xla", None])
def test_a_page_only_padding_names_reaches_no_sequence(implementation, monkeypatch):
    """The report's pools: an inf in page 0, which sequence 1 names only in a padding entry."""
    fake_kernels.install(monkeypatch)
    pages_k, pages_v, q = (jax.random.normal(key, shape) for key, shape in
                           zip(jax.random.split(jax.random.key(3), 3), ((6, 4, 2, 8), (6, 4, 2, 8), (2, 1, 4, 8))))  # fmt: skip
    table, lengths = jnp.asarray([[0, 1, 0], [2, 3, 0]]), jnp.asarray([8, 8])
    out = jax_flash.paged_attention(q, pages_k, pages_v.at[0, 3].set(jnp.inf), lengths, table, is_causal=True,
                                    implementation=implementation)  # fmt: skip
    clean = jax_flash.paged_attention(q, pages_k, pages_v, lengths, table, is_causal=True, implementation=implementation)
    assert np.isfinite(np.asarray(out[1])).all()
    _close(out[1], clean[1], 1e-6)
    # Stale slots past a sequence's length in a page it owns: ignored too.
    stale = pages_v.at[1, 3].set(jnp.nan)
    out = jax_flash.paged_attention(q, pages_k, stale, jnp.asarray([7, 8]), table, is_causal=True,
                                    implementation=implementation)  # fmt: skip
    assert np.isfinite(np.asarray(out)).all()


# ---- 3. Windows, integers, caps: no overflow, no wrap ----------------------------------------


@pytest.mark.parametrize("window", [2**31 - 1, (2**31 - 1, 3), (5, 2**31 - 1)])
def test_a_window_of_int32s_maximum_is_unbounded(run, window):
    q, k, v = _qkv(1, 10, 10)
    out = run(q, k, v, local_window_size=window, key_value_seq_lengths=jnp.asarray([8]))
    sides = (window, window) if isinstance(window, int) else window
    unbounded = tuple(None if w == 2**31 - 1 else w for w in sides)
    ref = jax.nn.dot_product_attention(q, k, v, local_window_size=tuple(10**3 if w is None else w for w in unbounded),
                                       key_value_seq_lengths=jnp.asarray([8], jnp.int32))  # fmt: skip
    _close(out, ref, run.tol)


def test_lengths_beyond_int32_do_not_wrap():
    q, k, v = _qkv(2, 4, 6)
    wide = np.asarray([2**32 + 3, -(2**33)], np.int64)  # all keys, no key
    out = jax_flash.attention(q, k, v, key_value_seq_lengths=wide, implementation="xla")
    _close(out[0], jax.nn.dot_product_attention(q[:1], k[:1], v[:1])[0])
    assert not np.asarray(out[1]).any()
    unsigned = jnp.asarray([2**31 + 5, 2], jnp.uint32)
    out = jax_flash.attention(q, k, v, key_value_seq_lengths=unsigned, implementation="xla")
    _close(out[0], jax.nn.dot_product_attention(q[:1], k[:1], v[:1])[0])


def test_wide_segment_ids_keep_their_equalities():
    q, k, v = _qkv(1, 6, 6)
    wide = np.asarray([[2**32 + 3, 2**32 + 3, 3, 3, 2**40, 2**40]], np.int64)  # 2**32 + 3 wraps onto 3
    out = jax_flash.attention(q, k, v, q_segment_ids=wide, kv_segment_ids=wide, implementation="xla")
    narrow = np.asarray([[0, 0, 1, 1, 2, 2]], np.int32)
    _close(out, jax_flash.attention(q, k, v, q_segment_ids=narrow, kv_segment_ids=narrow, implementation="xla"))
    traced = jax.jit(lambda s: jax_flash.attention(q, k, v, q_segment_ids=s, kv_segment_ids=s, implementation="xla"))
    _close(traced(jnp.asarray(wide)), out)


def test_page_indices_beyond_int32_are_clamped_not_wrapped():
    q, pages, _ = _qkv(1, 1, 8)
    pages = pages.reshape(2, 4, 2, 8)
    far = np.asarray([[0, 2**32 + 1]], np.int64)  # clamped to the last page (1), as page 1 here
    out = jax_flash.paged_attention(q, pages, pages, jnp.asarray([8]), far, implementation="xla")
    _close(out, jax_flash.paged_attention(q, pages, pages, jnp.asarray([8]), np.asarray([[0, 1]]), implementation="xla"))
    below = np.asarray([[0, -(2**32) + 1]], np.int64)  # clamped to page 0, not wrapped onto page 1
    out = jax_flash.paged_attention(q, pages, pages, jnp.asarray([8]), below, implementation="xla")
    _close(out, jax_flash.paged_attention(q, pages, pages, jnp.asarray([8]), np.asarray([[0, 0]]), implementation="xla"))


def test_a_soft_cap_beyond_float32_is_refused():
    q, k, v = _qkv(1, 4, 4)
    with pytest.raises(ValueError, match="softcap must be at most"):
        jax_flash.attention(q, k, v, softcap=3.5e38)
    assert np.isfinite(np.asarray(jax_flash.attention(q, k, v, softcap=1e30))).all()


@pytest.mark.parametrize("mask", [np.True_, True, np.bool_(True)])
def test_a_scalar_mask_is_taken_as_jax_nn_takes_it(mask):
    q, k, v = _qkv(1, 4, 4)
    _close(jax_flash.attention(q, k, v, mask=mask), jax.nn.dot_product_attention(q, k, v, mask=mask))


@pytest.mark.parametrize("shards", [0, -1, 1.5, True])
def test_zigzag_names_a_bad_shard_count(shards):
    with pytest.raises(ValueError, match="num_shards"):
        jax_flash.zigzag(jnp.zeros((1, 8, 1, 1)), shards)
    with pytest.raises(ValueError, match="num_shards"):
        jax_flash.unzigzag(jnp.zeros((1, 8, 1, 1)), shards)


def test_zigzag_names_a_length_that_does_not_split():
    with pytest.raises(ValueError, match="2 \\* num_shards"):
        jax_flash.zigzag(jnp.zeros((1, 6, 1, 1)), 2)


# ---- 5. The Flax modules: the documented input, and head shapes refused by name ---------------


def test_the_flax_modules_take_several_batch_axes():
    flax_nnx = pytest.importorskip("flax.nnx")
    import jax_flash.flax

    x = jax.random.normal(jax.random.key(0), (2, 3, 16, 32))
    module = jax_flash.flax.nnx.MultiHeadAttention(32, 4, rngs=flax_nnx.Rngs(0))
    flat = module(x.reshape(6, 16, 32)).reshape(x.shape)
    _close(module(x), flat)
    segments = jnp.tile(jnp.repeat(jnp.arange(2), 8), (2, 3, 1))
    _close(module(x, segment_ids=segments), module(x.reshape(6, 16, 32), segment_ids=segments.reshape(6, 16)).reshape(x.shape))
    linen = jax_flash.flax.linen.MultiHeadAttention(4)
    params = linen.init(jax.random.key(1), x)
    _close(linen.apply(params, x), linen.apply(params, x.reshape(6, 16, 32)).reshape(x.shape))


@pytest.mark.parametrize("features, heads, extra, match", [(4, 8, {}, "head_dim"), (32, 0, {}, "num_heads"),
                                                           (32, 4, dict(num_kv_heads=3), "num_kv_heads"),
                                                           (32, 4, dict(head_dim=0), "head_dim")])  # fmt: skip
def test_the_flax_modules_refuse_empty_heads_by_name(features, heads, extra, match):
    flax_nnx = pytest.importorskip("flax.nnx")
    import jax_flash.flax

    with pytest.raises(ValueError, match=match):
        jax_flash.flax.nnx.MultiHeadAttention(features, heads, rngs=flax_nnx.Rngs(0), **extra)
    linen = jax_flash.flax.linen.MultiHeadAttention(heads, **extra)
    with pytest.raises(ValueError, match=match):
        linen.init(jax.random.key(0), jnp.ones((1, 4, features)))


# ---- The kernels, in every family (the GPU issue runs these) ----------------------------------

FAMILIES = ("best", "sm80", "sm75")


def _kernel_call(family, monkeypatch):
    monkeypatch.setenv(_plan.KERNELS_ENV, family)
    if family == "sm75" and _plan.family() is not _plan.Family.TURING:
        pytest.skip("the Turing family is not built for this GPU")
    dtype = jnp.float16 if family == "sm75" else jnp.bfloat16
    return dtype, lambda *a, **kw: jax_flash.attention(*a, implementation="cuda", **kw)


def _finite_and_close(x, ref, tol):
    """A kernel's result: every element finite, within `tol` of the reference (relative norm)."""
    x = x.astype(jnp.float32)
    assert np.isfinite(np.asarray(x)).all()
    assert reference.rel_error(x, ref) < tol


def _close_to_float64(out, q, k, v, rtol, **kw):
    _finite_and_close(out, reference.attention(q, k, v, **kw)[0], rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("t, s, h", [(256, 256, 64), (200, 200, 128), (1, 4096, 128), (4, 1000, 64), (300, 1000, 128),
                                     (200, 330, 256), (130, 700, 320)])  # fmt: skip
@pytest.mark.parametrize("poison", [jnp.nan, jnp.inf])
def test_kernels_keep_poisoned_slots_out(family, monkeypatch, t, s, h, poison):
    if family == "sm75" and h > 128:
        pytest.skip("the Turing family takes head dims 64-128")
    dtype, run = _kernel_call(family, monkeypatch)
    q, k, v = _qkv(2, t, s, n=4, k=2, h=h, seed=t + s, dtype=dtype)
    lengths = jnp.asarray([s // 3 + 1, s - 5], jnp.int32)
    kw = dict(is_causal=True, key_value_seq_lengths=lengths)
    pk, pv = _poisoned(k, lengths, poison), _poisoned(v, lengths, poison)
    _close_to_float64(run(q, pk, pv, **kw), q, k, v, 2e-2, diagonal_by_lengths=t != s, **kw)
    if 16 < t and h <= 256:  # the backward kernels' gradients (decode shapes are forward calls)
        if not _plan.backward_kernels_fit(_plan.family(), h):  # under a shared-memory cap: refused, auto mode's instead
            with pytest.raises(ValueError, match="cannot differentiate"):
                jax.grad(lambda q: run(q, pk, pv, **kw).astype(jnp.float32).sum())(q)
            run = jax_flash.attention
        grad = jax.grad(lambda q, k, v: run(q, k, v, **kw).astype(jnp.float32).sum(), argnums=(0, 1, 2))
        grads, clean = grad(q, pk, pv), grad(q, k, v)
        for x, ref in zip(grads, clean):
            _finite_and_close(x, ref, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("page_size", [16, 64])
def test_kernels_keep_unowned_pages_out(family, monkeypatch, page_size):
    dtype, _ = _kernel_call(family, monkeypatch)
    keys = jax.random.split(jax.random.key(page_size), 3)
    pages_k = jax.random.normal(keys[0], (12, page_size, 2, 128), dtype)
    pages_v = jax.random.normal(keys[1], (12, page_size, 2, 128), dtype)
    q = jax.random.normal(keys[2], (2, 1, 8, 128), dtype)
    table = jnp.asarray([[4, 5, 0, 0], [2, 3, 0, 0]], jnp.int32)  # page 0: padding entries only
    lengths = jnp.asarray([page_size + 3, 2 * page_size], jnp.int32)
    # Page 0 and the pages no sequence names, and sequence 0's slots past its length (page 5).
    poisoned = pages_v.at[0].set(jnp.nan).at[1].set(jnp.nan).at[6:].set(jnp.nan).at[5, 3:].set(jnp.inf)
    out = jax_flash.paged_attention(q, pages_k, poisoned, lengths, table, is_causal=True)
    clean = jax_flash.paged_attention(q, pages_k, pages_v, lengths, table, is_causal=True, implementation="xla")
    _finite_and_close(out, clean, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("t", [8, 200])
def test_kernels_align_equal_lengths_as_jax_nn(family, monkeypatch, t):
    dtype, run = _kernel_call(family, monkeypatch)
    q, k, v = _qkv(2, t, t, n=4, k=2, h=64, seed=t, dtype=dtype)
    lengths = jnp.asarray([t // 2 + 1, t], jnp.int32)
    out = run(q, k, v, is_causal=True, key_value_seq_lengths=lengths)
    _close_to_float64(out, q, k, v, 2e-2, is_causal=True, key_value_seq_lengths=lengths)
    _finite_and_close(out, jax.nn.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths), 2e-2)


def test_the_docs_validate_helper_keeps_attentions_rule():
    """validate's default: the diagonal moves with lengths only where T != S."""
    q, k, v = _qkv(1, 4, 4)
    common = dict(scale=None, is_causal=True, query_seq_lengths=None, key_value_seq_lengths=jnp.asarray([3]),
                  local_window_size=None, implementation=None, return_residual=False, softcap=None,
                  q_segment_ids=None, kv_segment_ids=None)  # fmt: skip
    assert not validate(q, k, v, None, None, **common).config.diagonal_by_lengths
    assert validate(q, k[:, :3], v[:, :3], None, None, **common).config.diagonal_by_lengths
    assert validate(q, k, v, None, None, diagonal_by_lengths=True, **common).config.diagonal_by_lengths
    assert xla_impl.offset_per_row(validate(q, k[:, :3], v[:, :3], None, None, **common))
