"""ragged_paged_attention's kernels (the split-KV kernels over a work list, cuda/decode/, and prefill
chunks on the mma.sync forward's tiles) on a GPU, against the float64 reference run on each
sequence's gathered cache alone: mixed steps (a prefill
chunk, decodes, a speculative step, an empty sequence, padding past num_seqs), pages of 16-256
tokens, GQA groups 1-16, every decode head dim, windows, the soft cap, sinks, fp8 pools, one and
many splits. The pages a sequence does not own, the slots past its length, and the queries of
padding rows hold NaN; outputs land on NaN-poisoned memory; each call runs twice and must give
the same bits (a race would move)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _decode, _plan, _ragged_work
from tests import reference
from tests.cases import rng_for
from tests.test_cuda import poison_free_memory
from tests.test_ragged import poisoned, step_problem, step_reference

pytestmark = pytest.mark.gpu

TOL = 1e-2  # bf16/fp16 relative error against float64
Q_LENGTHS, KV_LENGTHS = [37, 1, 1, 4, 0, 1, 16], [300, 1, 77, 129, 12, 1000, 16]
NUM_SEQS = 6  # the last sequence and the spare rows are padding


@pytest.fixture(autouse=True)
def ragged_kernels_or_skip():
    if _plan.family() is _plan.Family.TURING:
        pytest.skip("the Turing kernels (on sm_75, or forced with JAX_FLASH_KERNELS=sm75) have no decode kernels")


def ragged_call(args, num_seqs, **kw):
    """The kernels' call, jitted anew (the split count is read when traced), twice on poisoned
    memory: the same bits both times."""
    fn = lambda *a: jax_flash.ragged_paged_attention(*a, jnp.int32(num_seqs), implementation="cuda",  # noqa: E731
                                                     return_residual=True, **kw)
    assert "jax_flash_ragged" in jax.jit(fn).lower(*args).as_text()
    results = []
    for _ in range(2):
        poison_free_memory()
        results.append(jax.jit(fn)(*args))
    for a, b in zip(*results):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    return results[0]


def check(dtype, page_size, heads=(32, 8), h=128, q_lengths=Q_LENGTHS, kv_lengths=KV_LENGTHS, num_seqs=NUM_SEQS,
          pools_dtype=None, **kw):  # fmt: skip
    rng = rng_for("cuda-ragged", dtype, page_size, heads, h, tuple(q_lengths), tuple(sorted(kw)), pools_dtype)
    queries, kp, vp, *rest = step_problem(rng, q_lengths, kv_lengths, page_size, dtype=dtype, heads=heads, h=h)
    if kw.pop("sinks", False):
        kw["sinks"] = jnp.asarray(rng.normal(size=(heads[0],)) * 2, jnp.float32)
    scales = None
    if pools_dtype is not None:  # fp8 pools, one scale per kv head
        (kp, ks), (vp, vs) = (jax_flash.quantize_kv(x, pools_dtype) for x in (kp, vp))
        scales = (ks, vs)
    ref_out, ref_lse = step_reference(queries, kp, vp, *rest, num_seqs, scales=scales, **kw)
    if scales is not None:
        kw.update(key_scale=scales[0], value_scale=scales[1])
    out, lse = ragged_call((*poisoned(queries, kp, vp, *rest, num_seqs), *rest), num_seqs, **kw)
    live = int(rest[2][num_seqs])
    assert out.dtype == dtype and not np.isnan(np.asarray(out, np.float32)).any()
    assert reference.rel_error(out, ref_out) < TOL
    assert reference.rel_error(lse[:live], ref_lse[:live]) < 1e-3
    assert np.all(np.asarray(out[live:], np.float32) == 0) and np.all(np.isneginf(np.asarray(lse[live:])))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (16, 1)])
def test_a_mixed_step(dtype, page_size, heads):
    check(dtype, page_size, heads)


@pytest.mark.parametrize("prefill", ["0", "1"])
@pytest.mark.parametrize("h", [32, 64, 96, 192, 256])
def test_every_head_dim(monkeypatch, h, prefill):
    monkeypatch.setenv(_ragged_work.PREFILL_ENV, prefill)
    check(jnp.bfloat16, 16, h=h)


@pytest.mark.parametrize("kw", [dict(local_window_size=40), dict(softcap=5.0), dict(sinks=True),
                                dict(local_window_size=7, softcap=3.0, sinks=True)], ids=str)
@pytest.mark.parametrize("prefill", ["0", "1"])
def test_windows_soft_cap_and_sinks(monkeypatch, kw, prefill):
    monkeypatch.setenv(_ragged_work.PREFILL_ENV, prefill)
    check(jnp.bfloat16, 64, **kw)


@pytest.mark.parametrize("pools_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("h", [64, 128])
def test_fp8_pools(pools_dtype, h):
    check(jnp.bfloat16, 16, h=h, pools_dtype=pools_dtype, sinks=True)


@pytest.mark.parametrize("splits", ["1", "3", "16"])
def test_one_and_many_splits(monkeypatch, splits):
    monkeypatch.setenv(_decode.SPLITS_ENV, splits)
    check(jnp.bfloat16, 16, q_lengths=[2, 1, 1], kv_lengths=[3000, 1, 700], num_seqs=3)


@pytest.mark.parametrize("prefill", ["0", "1"])
def test_a_long_prefill_chunk_beside_decodes(monkeypatch, prefill):
    """1,000 queries (250 tiles of each kv head) over a 3,000-token cache, beside decodes, and a
    chunk with more queries than cached tokens (its first rows see nothing: 0)."""
    monkeypatch.setenv(_ragged_work.PREFILL_ENV, prefill)
    check(jnp.bfloat16, 64, q_lengths=[1000, 1, 1, 50, 1], kv_lengths=[3000, 20, 4000, 30, 1], num_seqs=5)


@pytest.mark.parametrize("h", [64, 128, 256])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("heads", [(8, 2), (32, 8)])
def test_prefill_items_on_the_forward_tiles(monkeypatch, heads, page_size, h):
    """With the switch on, chunks of more than 16 queries take the forward kernels' tiles (128
    queries an item: 300 queries are three, 129 two, 17 one), beside decodes and a 16-query
    sequence of the split kernels; a chunk over fewer cached tokens than pages hold."""
    monkeypatch.setenv(_ragged_work.PREFILL_ENV, "1")
    check(jnp.bfloat16, page_size, heads, h, q_lengths=[300, 16, 129, 17, 0, 128, 1],
          kv_lengths=[300, 40, 200, 17, 5, 400, 33], num_seqs=7)


def test_decodes_alone_equal_paged_attention():
    """A batch of decodes only: the rows that paged_attention gives, within rounding."""
    rng = rng_for("cuda-ragged-paged")
    lengths = [1, 16, 17, 300, 2049, 64]
    queries, kp, vp, kv_lengths, table, starts = step_problem(rng, [1] * 6, lengths, 64, dtype=jnp.bfloat16,
                                                              heads=(32, 8), spare_rows=0)  # fmt: skip
    out = jax_flash.ragged_paged_attention(queries, kp, vp, kv_lengths, table, starts, implementation="cuda")
    paged = jax_flash.paged_attention(queries[:, None], kp, vp, kv_lengths, table, is_causal=True,
                                      implementation="cuda")  # fmt: skip
    assert reference.rel_error(out, paged[:, 0]) < 2e-3
