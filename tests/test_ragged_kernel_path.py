"""ragged_paged_attention's kernel path on CPU: its work list (_ragged_work.py) covers every row of
every sequence once and nothing else, within its static bound; the Python around the custom call
(routing, operands, masking of rows no item covers) runs through tests/fake_kernels.py, which
computes each row as the work list covers it and leaves the rest NaN, as the kernels do."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _operands, _plan, _ragged_work, _search
from tests import fake_kernels, reference
from tests.cases import rng_for
from tests.test_ragged import step_problem, step_reference

TILE = _ragged_work.TILE_ROWS
PREFILL = _ragged_work.PREFILL_ROWS
DECODE_QUERIES = _ragged_work.DECODE_QUERIES


def _covered(work, prefill_work, q_rows, group):
    """(query row, head of the group) -> how many items of either list cover it, and the items'
    sequences."""
    count = np.zeros((q_rows, group), np.int64)
    seq_of_row = np.full(q_rows, -1)

    def cover(seq, row, heads):
        count[row, heads] += 1
        assert seq_of_row[row] in (-1, seq)
        seq_of_row[row] = seq

    for seq, first, row0, queries in np.asarray(work):
        if seq >= 0:
            for packed in range(first, min(first + TILE, queries * group)):
                cover(seq, row0 + packed // group, packed % group)
    for seq, first, row0, queries in np.asarray(prefill_work):
        if seq >= 0:
            assert queries > DECODE_QUERIES and first % PREFILL == 0
            for query in range(first, min(first + PREFILL, queries)):
                cover(seq, row0 + query, slice(None))
    return count, seq_of_row


@pytest.mark.parametrize("prefill", [False, True])
@pytest.mark.parametrize("compare_all", [True, False])
@pytest.mark.parametrize("group", [1, 3, 4, 16])
def test_the_work_lists_cover_each_row_once(monkeypatch, group, compare_all, prefill):
    """Random steps (empty sequences, prefills, decodes, padding past num_seqs), and those that
    fill the bounds (every sequence one row past a whole tile; one query past a prefill item); each
    sequence found by comparing every pair, and by a sort. With a prefill list, sequences of more
    than DECODE_QUERIES queries are its items' alone."""
    if not compare_all:
        monkeypatch.setattr(_search, "COMPARE_ALL_LIMIT", 0)
    rng = np.random.default_rng(group)
    worst = [TILE // group + 1 if group < TILE else 1] * 7
    worst_prefill = [PREFILL + 1] * 3 + [DECODE_QUERIES + 1] * 4
    cases = [list(rng.integers(0, 40, size=9)), [0, 0, 0], [1] * 12, worst, [63, 0, 1, 2, 17],
             [300, 16, 129, 17, 0, 128, 1], worst_prefill]  # fmt: skip
    for q_lengths in cases:
        sequences = len(q_lengths)
        num_seqs = sequences - 2 if len(q_lengths) in (9, 12) else sequences
        starts = np.concatenate([[0], np.cumsum(q_lengths)]).astype(np.int32)
        q_rows = int(starts[-1]) + 2
        items = _ragged_work.items_bound(q_rows, sequences, group)
        prefill_items = _ragged_work.prefill_items_bound(q_rows, sequences) if prefill else 0
        work, prefill_work = _ragged_work.work_list(jnp.asarray(starts), jnp.int32(num_seqs), group, items,
                                                    prefill_items)  # fmt: skip
        assert work.shape == (items, _ragged_work.FIELDS) and prefill_work.shape == (prefill_items, 4)
        count, seq_of_row = _covered(work, prefill_work, q_rows, group)
        live = int(starts[num_seqs])
        assert np.all(count[:live] == 1) and np.all(count[live:] == 0)
        expect = np.searchsorted(starts[1:], np.arange(live), side="right")
        np.testing.assert_array_equal(seq_of_row[:live], expect)
        # The items past the tiles name no sequence; neither list outgrows its bound.
        chunks = [q for q in q_lengths[:num_seqs] if prefill and q > DECODE_QUERIES]
        tiles = sum(-(-q * group // TILE) for q in q_lengths[:num_seqs]) - sum(-(-q * group // TILE) for q in chunks)
        blocks = sum(-(-q // PREFILL) for q in chunks)
        assert np.all(np.asarray(work[:tiles, 0]) >= 0) and np.all(np.asarray(work[tiles:, 0]) == -1)
        assert np.all(np.asarray(prefill_work[:blocks, 0]) >= 0) and np.all(np.asarray(prefill_work[blocks:, 0]) == -1)
    for lengths in (worst, worst_prefill):
        q_rows = sum(lengths)
        assert sum(-(-q * group // TILE) for q in lengths) <= _ragged_work.items_bound(q_rows, len(lengths), group)
    assert 3 * 2 + 4 == _ragged_work.prefill_items_bound(sum(worst_prefill), len(worst_prefill))
    assert _ragged_work.prefill_items_bound(DECODE_QUERIES * 9, 9) >= 1  # one chunk of them all
    assert _ragged_work.prefill_items_bound(DECODE_QUERIES, 9) == 0


@pytest.mark.parametrize("compare_all", [True, False])
def test_the_work_list_is_made_without_a_loop(monkeypatch, compare_all):
    """No while loop in its program: on a GPU each trip of one waits on the host (no CUDA graph,
    0.5 ms a step)."""
    if not compare_all:
        monkeypatch.setattr(_search, "COMPARE_ALL_LIMIT", 0)
    text = jax.jit(lambda s, n: _ragged_work.work_list(s, n, 4, 40, 6)).lower(jnp.zeros((9,), jnp.int32),
                                                                              jnp.int32(8)).as_text()  # fmt: skip
    assert "while" not in text


CASES = {"plain": {}, "window": {"local_window_size": 9}, "softcap": {"softcap": 4.0}, "sinks": {"sinks": True}}


@pytest.mark.parametrize("prefill", ["0", "1"])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (16, 1)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_kernel_path_against_float64(monkeypatch, heads, case, prefill):
    """implementation="cuda" through the stand-in: a prefill chunk (on the split kernels' tiles, or
    with the switch on the forward tiles'), decodes, a speculative step, an empty sequence and
    padding past num_seqs, pages of 16 and 64 tokens."""
    monkeypatch.setenv(_ragged_work.PREFILL_ENV, prefill)
    calls = fake_kernels.record_calls(monkeypatch)
    for page_size in (16, 64):
        rng = rng_for("ragged-kernels", heads, case, page_size)
        q_lengths, kv_lengths = [20, 1, 1, 4, 0, 1, 3], [45, 1, page_size, 70, 12, 30, 9]
        queries, kp, vp, lengths, table, starts = step_problem(rng, q_lengths, kv_lengths, page_size,
                                                                dtype=jnp.bfloat16, heads=heads)  # fmt: skip
        kw = dict(CASES[case])
        if kw.pop("sinks", False):
            kw["sinks"] = jnp.asarray(rng.normal(size=(heads[0],)), jnp.float32)
        out, lse = jax_flash.ragged_paged_attention(queries, kp, vp, lengths, table, starts, jnp.int32(5),
                                                    return_residual=True, implementation="cuda", **kw)  # fmt: skip
        ref_out, ref_lse = step_reference(queries, kp, vp, lengths, table, starts, 5, **kw)
        live = int(starts[5])
        assert out.dtype == jnp.bfloat16 and not np.isnan(np.asarray(out, np.float32)).any()
        assert reference.rel_error(out, ref_out) < 1e-2
        assert reference.rel_error(lse[:live], ref_lse[:live]) < 1e-3
        assert np.all(np.asarray(out[live:], np.float32) == 0) and np.all(np.isneginf(np.asarray(lse[live:])))
    attrs = calls.attrs["jax_flash_ragged"]
    assert int(attrs["window_right"]) == 0 and int(attrs["diagonal_by_lengths"]) == 1
    assert [t for t, _ in calls] == ["jax_flash_ragged"] * 2


@pytest.mark.parametrize("case", ["plain", "window", "sinks"])
def test_prefill_chunks_take_the_forward_tiles(monkeypatch, case):
    """With the switch on, sequences of more than DECODE_QUERIES queries go to the prefill list
    (300 queries: three items), the rest to the split kernels' list, in one call; fp8 pools send
    every sequence to the split kernels (the forward kernels read no fp8), as the switch's default
    (off) does."""
    monkeypatch.setenv(_ragged_work.PREFILL_ENV, "1")
    calls = fake_kernels.record_calls(monkeypatch)
    rng = rng_for("ragged-kernels-prefill", case)
    q_lengths, kv_lengths = [300, 16, 129, 17, 0, 128, 1], [300, 40, 200, 17, 5, 400, 33]
    args = step_problem(rng, q_lengths, kv_lengths, 16, dtype=jnp.bfloat16, heads=(8, 2), h=64)
    kw = dict(CASES[case])
    if kw.pop("sinks", False):
        kw["sinks"] = jnp.asarray(rng.normal(size=(8,)), jnp.float32)
    out = jax_flash.ragged_paged_attention(*args, implementation="cuda", **kw)
    ref, _ = step_reference(*args, len(q_lengths), **kw)
    assert reference.rel_error(out, ref) < 1e-2
    fields = _operands.RaggedOperands._fields
    shapes = dict(zip(fields, calls[0][1]))
    assert shapes["prefill_work"] == (_ragged_work.prefill_items_bound(args[0].shape[0], len(q_lengths)), 4)
    assert shapes["prefill_work"][0] >= 3 + 2 + 1 + 1  # 300, 129, 17, 128 queries
    queries, kp, vp, *rest = args
    (kq, ks), (vq, vs) = (jax_flash.quantize_kv(x, jnp.float8_e4m3fn) for x in (kp, vp))
    out = jax_flash.ragged_paged_attention(queries, kq, vq, *rest, key_scale=ks, value_scale=vs,
                                           implementation="cuda", **kw)  # fmt: skip
    ref, _ = step_reference(queries, kq, vq, *rest, len(q_lengths), scales=(ks, vs), **kw)
    assert reference.rel_error(out, ref) < 1e-2
    assert dict(zip(fields, calls[1][1]))["prefill_work"] == (0, 4)
    monkeypatch.delenv(_ragged_work.PREFILL_ENV)
    jax_flash.ragged_paged_attention(*args, implementation="cuda", **kw)
    assert dict(zip(fields, calls[2][1]))["prefill_work"] == (0, 4)
    monkeypatch.setenv(_ragged_work.PREFILL_ENV, "yes")
    with pytest.raises(ValueError, match="JAX_FLASH_RAGGED_PREFILL must be '0' or '1'"):
        jax_flash.ragged_paged_attention(*args, implementation="cuda", **kw)


def test_fp8_pools_through_the_kernel_path(monkeypatch):
    fake_kernels.install(monkeypatch)
    rng = rng_for("ragged-kernels-fp8")
    queries, kp, vp, lengths, table, starts = step_problem(rng, [6, 1, 2], [20, 33, 2], 16, dtype=jnp.bfloat16, h=64)
    (kq, ks), (vq, vs) = (jax_flash.quantize_kv(x, jnp.float8_e5m2) for x in (kp, vp))
    out = jax_flash.ragged_paged_attention(queries, kq, vq, lengths, table, starts, key_scale=ks, value_scale=vs,
                                           implementation="cuda")  # fmt: skip
    ref, _ = step_reference(queries, kq, vq, lengths, table, starts, 3, scales=(ks, vs))
    assert reference.rel_error(out, ref) < 1e-2


def test_one_compiled_step_and_vmap_through_the_kernel_path(monkeypatch):
    """The work list is made from arrays: one jitted step serves batches of other shapes of work;
    under vmap the steps run one kernel call after another."""
    fake_kernels.install(monkeypatch)
    rng = rng_for("ragged-kernels-jit")
    queries, kp, vp, lengths, table, _ = step_problem(rng, [5, 1, 1, 1], [10, 20, 30, 40], 16, dtype=jnp.bfloat16,
                                                      spare_rows=0)  # fmt: skip
    traces = []

    @jax.jit
    def step(queries, starts, num_seqs):
        traces.append(1)
        return jax_flash.ragged_paged_attention(queries, kp, vp, lengths, table, starts, num_seqs,
                                                implementation="cuda")  # fmt: skip

    all_starts = []
    for q_lengths, num in (([5, 1, 1, 1], 4), ([2, 2, 2, 2], 4), ([8, 0, 0, 0], 1)):
        starts = jnp.asarray(np.concatenate([[0], np.cumsum(q_lengths)]), jnp.int32)
        ref, _ = step_reference(queries, kp, vp, lengths, table, starts, num)
        assert reference.rel_error(step(queries, starts, jnp.int32(num)), ref) < 1e-2
        all_starts.append((starts, ref))
    assert len(traces) == 1
    batched = jax.vmap(step, in_axes=(None, 0, None))(queries, jnp.stack([s for s, _ in all_starts[:2]]), jnp.int32(4))
    for i in range(2):
        assert reference.rel_error(batched[i], all_starts[i][1]) < 1e-2


def test_calls_the_kernels_do_not_take(monkeypatch):
    """Auto mode takes the xla path (no custom call), implementation="cuda" says why: head dims
    without decode kernels, pages of no multiple of 16 tokens, float32 queries, the Turing family."""
    calls = fake_kernels.record_calls(monkeypatch)
    rng = rng_for("ragged-kernels-refused")
    cases = [(dict(h=40), jnp.bfloat16, 16, "the ragged kernels read head dims"),
             (dict(), jnp.bfloat16, 8, "pages of a multiple of 16"),
             (dict(), jnp.float32, 16, "float16 or bfloat16 queries")]  # fmt: skip
    for shape, dtype, page_size, why in cases:
        args = step_problem(rng, [3, 1], [20, 9], page_size, dtype=dtype, **shape)
        ref, _ = step_reference(*args, 2)
        assert reference.rel_error(jax_flash.ragged_paged_attention(*args), ref) < 1e-2
        with pytest.raises(ValueError, match=f"implementation=.cuda. cannot run ragged_paged_attention: .*{why}"):
            jax_flash.ragged_paged_attention(*args, implementation="cuda")
    monkeypatch.setattr(_plan, "family", lambda: _plan.Family.TURING)
    with pytest.raises(ValueError, match="run from sm_80 on"):
        jax_flash.ragged_paged_attention(*step_problem(rng, [2], [5], 16, dtype=jnp.float16), implementation="cuda")
    assert not calls


def test_without_the_extension_cuda_says_why():
    rng = rng_for("ragged-kernels-cpu")
    args = step_problem(rng, [3], [5], 16, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="implementation='cuda' cannot run ragged_paged_attention: "):
        jax_flash.ragged_paged_attention(*args, implementation="cuda")


def test_a_step_without_queries(monkeypatch):
    """Q = 0 launches nothing: empty results of the right shapes."""
    calls = fake_kernels.record_calls(monkeypatch)
    rng = rng_for("ragged-kernels-empty")
    queries, kp, vp, lengths, table, _ = step_problem(rng, [2], [5], 16, dtype=jnp.bfloat16)
    out, lse = jax_flash.ragged_paged_attention(queries[:0], kp, vp, lengths, table, jnp.zeros((2,), jnp.int32),
                                                return_residual=True, implementation="cuda")  # fmt: skip
    assert out.shape == (0,) + queries.shape[1:] and lse.shape == (0, queries.shape[1]) and not calls
