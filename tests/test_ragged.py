"""ragged_paged_attention (DESIGN.md's contract): a serving step's mixed batch (a prefill chunk,
decodes, a speculative step, an empty sequence, padding past num_seqs) over one pool of shuffled
pages, against the float64 reference run on each sequence's gathered cache alone; windows, soft
cap, sinks, fp8 pools, float64; runtime values made valid; jit over num_seqs; bad input by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import ragged
from tests import reference
from tests.cases import rng_for

N, K, H = 8, 2, 32


def step_problem(rng, q_lengths, kv_lengths, page_size, dtype=jnp.float32, spare_rows=3, sequences=None, heads=(N, K),
                 h=H):  # fmt: skip
    """(queries, key_pages, value_pages, kv_lengths, page_indices, query_starts) of a step: each
    sequence's pages shuffled through one pool, sequences past the lengths given as padding."""
    sequences = sequences or len(q_lengths)
    n, kv_heads = heads
    max_pages = max(1, -(-max(kv_lengths) // page_size))
    pool = sequences * max_pages + 2
    key_pages, value_pages = (jnp.asarray(rng.normal(size=(pool, page_size, kv_heads, h)), dtype) for _ in range(2))
    table = jnp.asarray(rng.permutation(pool)[: sequences * max_pages].reshape(sequences, max_pages), jnp.int32)
    starts = np.concatenate([[0], np.cumsum(q_lengths)]).astype(np.int32)
    starts = np.concatenate([starts, np.full(sequences - len(q_lengths), starts[-1], np.int32)])
    queries = jnp.asarray(rng.normal(size=(starts[-1] + spare_rows, n, h)), dtype)
    lengths = np.concatenate([kv_lengths, np.zeros(sequences - len(kv_lengths), np.int32)]).astype(np.int32)
    return queries, key_pages, value_pages, jnp.asarray(lengths), table, jnp.asarray(starts)


def step_reference(queries, key_pages, value_pages, lengths, table, starts, num_seqs, sinks=None, scales=None, **kw):
    """Each sequence alone (float64): its queries against its gathered cache, the last q_i
    positions; rows of no sequence 0 (lse -inf)."""
    _, _, kv_heads, h = key_pages.shape
    out = np.zeros(queries.shape, np.float64)
    lse = np.full(queries.shape[:2], -np.inf)
    pages_k, pages_v = (x.astype(jnp.float64) for x in (key_pages, value_pages))
    if scales is not None:
        pages_k, pages_v = pages_k * scales[0][:, None], pages_v * scales[1][:, None]
    for i in range(num_seqs):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        t = rows.stop - rows.start
        if t == 0:
            continue
        keys = jnp.take(pages_k, table[i], axis=0).reshape(1, -1, kv_heads, h)
        values = jnp.take(pages_v, table[i], axis=0).reshape(1, -1, kv_heads, h)
        o, l = reference.attention(queries[None, rows], keys, values, is_causal=True, sinks=sinks,
                                   key_value_seq_lengths=lengths[i:i + 1], query_seq_lengths=jnp.asarray([t]),
                                   diagonal_by_lengths=True, **kw)  # fmt: skip
        out[rows], lse[rows] = np.asarray(o[0]), np.asarray(l[0])
    return out, lse


def poisoned(queries, key_pages, value_pages, lengths, table, starts, num_seqs):
    """NaN in every page slot that no sequence below num_seqs reads (past its length, or a page
    of none) and in the query rows past starts[num_seqs]."""
    page_size = key_pages.shape[1]
    owned = np.zeros(key_pages.shape[:2], bool)
    for i in range(num_seqs):
        for slot in range(int(lengths[i])):
            owned[int(table[i, slot // page_size]), slot % page_size] = True
    mask = jnp.asarray(owned)[:, :, None, None]
    key_pages, value_pages = (jnp.where(mask, x, jnp.nan).astype(x.dtype) for x in (key_pages, value_pages))
    live = jnp.arange(queries.shape[0]) < starts[num_seqs]
    return jnp.where(live[:, None, None], queries, jnp.nan).astype(queries.dtype), key_pages, value_pages


CASES = {"plain": {}, "window": {"local_window_size": 9}, "softcap": {"softcap": 4.0}, "sinks": {"sinks": True}}


@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_mixed_step_against_float64(page_size, case):
    """A 20-token prefill chunk, three decodes (one at a page's edge), a 4-token speculative step,
    a sequence with no new token, then two sequences past num_seqs and spare rows."""
    rng = rng_for("ragged", page_size, case)
    q_lengths, kv_lengths = [20, 1, 1, 4, 0, 1, 3], [45, 1, page_size, 37, 12, 30, 9]
    queries, kp, vp, lengths, table, starts = step_problem(rng, q_lengths, kv_lengths, page_size)
    kw = dict(CASES[case])
    if kw.pop("sinks", False):
        kw["sinks"] = jnp.asarray(rng.normal(size=(N,)), jnp.float32)
    out, lse = jax_flash.ragged_paged_attention(queries, kp, vp, lengths, table, starts, jnp.int32(5),
                                                return_residual=True, **kw)  # fmt: skip
    ref_out, ref_lse = step_reference(queries, kp, vp, lengths, table, starts, 5, **kw)
    assert out.shape == queries.shape and out.dtype == queries.dtype
    assert reference.rel_error(out, ref_out) < 1e-5
    assert reference.rel_error(lse[: starts[5]], ref_lse[: starts[5]]) < 1e-5
    assert np.all(np.asarray(out[int(starts[5]):]) == 0)  # past num_seqs and the spare rows
    assert np.all(np.isneginf(np.asarray(lse[int(starts[5]):])))


def test_fp8_pools_and_float64():
    rng = rng_for("ragged-fp8")
    queries, kp, vp, lengths, table, starts = step_problem(rng, [6, 1, 2], [20, 33, 2], 16)
    (kq, ks), (vq, vs) = (jax_flash.quantize_kv(x, jnp.float8_e4m3fn) for x in (kp, vp))
    out = jax_flash.ragged_paged_attention(queries.astype(jnp.bfloat16), kq, vq, lengths, table, starts,
                                           key_scale=ks, value_scale=vs)  # fmt: skip
    ref, _ = step_reference(queries.astype(jnp.bfloat16), kq, vq, lengths, table, starts, 3, scales=(ks, vs))
    assert out.dtype == jnp.bfloat16 and reference.rel_error(out, ref) < 1e-2
    out64 = jax_flash.ragged_paged_attention(*(x.astype(jnp.float64) for x in (queries, kp, vp)), lengths, table, starts)
    ref64, _ = step_reference(queries, kp, vp, lengths, table, starts, 3)
    assert out64.dtype == jnp.float64 and reference.rel_error(out64, ref64) < 1e-12


def test_one_compiled_step_serves_every_batch():
    """num_seqs and the starts are arrays: one jitted step, other batches, no retrace."""
    rng = rng_for("ragged-jit")
    queries, kp, vp, lengths, table, starts = step_problem(rng, [5, 1, 1, 1], [10, 20, 30, 40], 8, spare_rows=0)
    traces = []

    @jax.jit
    def step(queries, lengths, starts, num_seqs):
        traces.append(1)
        return jax_flash.ragged_paged_attention(queries, kp, vp, lengths, table, starts, num_seqs)

    for q_lengths, num in (([5, 1, 1, 1], 4), ([2, 2, 2, 2], 4), ([8, 0, 0, 0], 1)):
        starts = jnp.asarray(np.concatenate([[0], np.cumsum(q_lengths)]), jnp.int32)
        out = step(queries, lengths, starts, jnp.int32(num))
        ref, _ = step_reference(queries, kp, vp, lengths, table, starts, num)
        assert reference.rel_error(out, ref) < 1e-5
    assert len(traces) == 1


def test_runtime_values_are_made_valid():
    """Decreasing starts take a running maximum; lengths past the pages are clipped to them; a
    sequence with fewer tokens than new queries leaves its first queries seeing nothing (0);
    page indices outside the pool read a page of it."""
    rng = rng_for("ragged-clamp")
    queries, kp, vp, lengths, table, _ = step_problem(rng, [4, 3], [16, 16], 8, spare_rows=0)
    starts = jnp.asarray([5, 4, 2], jnp.int32)  # -> [0, 4, 4]: sequence 1 has no queries
    out = jax_flash.ragged_paged_attention(queries, kp, vp, jnp.asarray([2, 99]), table.at[1, 0].set(10**6), starts)
    fixed_table = table.at[1, 0].set(kp.shape[0] - 1)
    ref, _ = step_reference(queries, kp, vp, jnp.asarray([2, 16]), fixed_table, jnp.asarray([0, 4, 4]), 2)
    assert reference.rel_error(out, ref) < 1e-5
    assert np.all(np.asarray(out[:2]) == 0) and np.all(np.asarray(out[4:]) == 0)  # positions -2, -1; padding


def test_forward_only():
    rng = rng_for("ragged-grad")
    queries, kp, vp, lengths, table, starts = step_problem(rng, [3], [5], 8)
    with pytest.raises(ValueError, match="ragged_paged_attention is forward only"):
        jax.grad(lambda q: jnp.sum(jax_flash.ragged_paged_attention(q, kp, vp, lengths, table, starts)))(queries)


def test_the_walk_takes_chunks_of_pages(monkeypatch):
    """With a small CHUNK_BYTES the walk takes one page a step: the same result."""
    rng = rng_for("ragged-chunks")
    args = step_problem(rng, [7, 1], [40, 17], 8)
    whole = jax_flash.ragged_paged_attention(*args)
    monkeypatch.setattr(ragged, "CHUNK_BYTES", 1)
    assert reference.rel_error(jax_flash.ragged_paged_attention(*args), whole) < 1e-6


@pytest.mark.parametrize("change,error,match", [
    (dict(queries=jnp.zeros((4, 8, 32, 1))), ValueError, r"queries must have shape \[Q, N, H\]"),
    (dict(queries=jnp.zeros((4, 8, 32), jnp.int32)), TypeError, "queries dtype must be one of"),
    (dict(key_pages=jnp.zeros((3, 8, 2, 32), jnp.bfloat16)), TypeError, "queries and key_pages must share one dtype"),
    (dict(kv_lengths=jnp.zeros((3,), jnp.int32)), ValueError, r"kv_lengths must have shape \[S\] = \(2,\)"),
    (dict(query_starts=jnp.zeros((2,), jnp.int32)), ValueError, r"query_starts must have shape \[S \+ 1\] = \(3,\)"),
    (dict(page_indices=jnp.zeros((2,), jnp.int32)), ValueError, r"page_indices must have shape \[S, max_pages >= 1\]"),
    (dict(num_seqs=jnp.zeros((2,), jnp.int32)), ValueError, "num_seqs must be an int scalar"),
    (dict(local_window_size=-1), ValueError, "local_window_size values must be >= 0"),
    (dict(softcap=0.0), ValueError, "softcap must be"),
    (dict(implementation="tpu"), ValueError, "implementation must be"),
])  # fmt: skip
def test_bad_input_is_refused_by_name(change, error, match):
    args = dict(queries=jnp.zeros((4, 8, 32)), key_pages=jnp.zeros((3, 8, 2, 32)), value_pages=jnp.zeros((3, 8, 2, 32)),
                kv_lengths=jnp.asarray([3, 4]), page_indices=jnp.zeros((2, 1), jnp.int32),
                query_starts=jnp.asarray([0, 2, 4]))  # fmt: skip
    if "value_pages" not in change and "key_pages" in change:
        change = dict(change, value_pages=change["key_pages"])
    args.update(change)
    with pytest.raises(error, match=match):
        jax_flash.ragged_paged_attention(**args)


def test_the_continuous_batching_example(monkeypatch, capsys):
    """examples/serve.py: requests arriving over time, prefill chunks and decodes in one step over
    pages from a free list, give the tokens that padded dense batches give (greedy, the same model)."""
    import pathlib
    import sys

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "examples"))
    import serve

    served, dense = serve.main(["--requests", "6", "--slots", "3", "--budget", "40", "--new-tokens", "5",
                                "--train-steps", "2"])  # fmt: skip
    assert [r.out for r in served] == dense and all(len(r.out) == 5 for r in served)
    assert "continuous / padded tokens/s" in capsys.readouterr().out
    sys.modules.pop("serve", None)


def test_slots_no_sequence_reads_never_reach_the_output():
    """NaN in the pages past each sequence's length, in pages of no sequence, in the slots past a
    length inside its last page, and in the padding rows' queries: the same output as clean ones."""
    rng = rng_for("ragged-poison")
    args = step_problem(rng, [20, 1, 4, 0, 2], [45, 9, 37, 12, 30], 8)
    clean = jax_flash.ragged_paged_attention(*args, jnp.int32(4))
    dirty = jax_flash.ragged_paged_attention(*poisoned(*args, 4), *args[3:], jnp.int32(4))
    np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))
