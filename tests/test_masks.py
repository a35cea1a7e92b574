"""The kernels' mask operands (`jax_flash._masks`), checked on CPU: the chunk ranges must cover
every visible (query, key) pair, skip what packed documents do not share, and call a block one
segment only where it is."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash._masks import CHUNK, CHUNK_FIELDS, kernel_masks
from tests.cases import rng_for


def _pairs_covered(q_seg, kv_seg, masks):
    """Every pair with equal segment ids lies in its query chunk's key range and in its key
    chunk's query range."""
    q_chunks, kv_chunks = np.asarray(masks.q_chunks), np.asarray(masks.kv_chunks)
    for b in range(q_seg.shape[0]):
        qi, kj = np.nonzero(q_seg[b][:, None] == kv_seg[b][None, :])
        qc, kc = q_chunks[b, qi // CHUNK], kv_chunks[b, kj // CHUNK]
        assert ((qc[:, 2] <= kj) & (kj < qc[:, 3])).all()
        assert ((kc[:, 2] <= qi) & (qi < kc[:, 3])).all()
        assert (qc[:, 0] <= q_seg[b][qi]).all() and (q_seg[b][qi] <= qc[:, 1]).all()


def _one_segment_ranges_hold_one_id(q_seg, kv_seg, masks):
    """A chunk's one-segment range holds only rows of the other side with the chunk's one id (the
    kernels then compare no ids there)."""
    for chunks, own, other in ((masks.q_chunks, q_seg, kv_seg), (masks.kv_chunks, kv_seg, q_seg)):
        chunks = np.asarray(chunks)
        for b in range(own.shape[0]):
            for c in range(chunks.shape[1]):
                begin, end = chunks[b, c, 4:6]
                if begin < end:
                    ids = own[b, c * CHUNK:(c + 1) * CHUNK]
                    assert (ids == ids[0]).all() and (other[b, begin:end] == ids[0]).all()


@pytest.mark.parametrize("t,s", [(1, 1), (64, 64), (100, 300), (1000, 999)])
@pytest.mark.parametrize("sorted_ids", [True, False])
def test_chunk_ranges_cover_every_visible_pair(t, s, sorted_ids):
    rng = rng_for("chunks", t, s, sorted_ids)
    draw = lambda n: np.sort(rng.integers(0, 5, size=(3, n)), axis=1) if sorted_ids else rng.integers(0, 5, size=(3, n))  # noqa: E731
    q_seg, kv_seg = draw(t), draw(s)
    masks = kernel_masks(3, t, s, None, None, jnp.asarray(q_seg), jnp.asarray(kv_seg))
    assert masks.q_chunks.shape == (3, -(-t // CHUNK), CHUNK_FIELDS)
    assert masks.kv_chunks.shape == (3, -(-s // CHUNK), CHUNK_FIELDS)
    _pairs_covered(q_seg, kv_seg, masks)
    _one_segment_ranges_hold_one_id(q_seg, kv_seg, masks)


def _chunk_spans(ids):
    """(smallest, largest) id of each CHUNK rows."""
    return [(ids[i:i + CHUNK].min(), ids[i:i + CHUNK].max()) for i in range(0, len(ids), CHUNK)]


@pytest.mark.parametrize("t,s", [(64, 64), (100, 300), (1000, 999)])
def test_chunk_ranges_are_the_first_and_last_meeting_chunks(t, s):
    """Against a loop over chunk pairs: each range runs from the first chunk of the other side
    whose segment id range meets this chunk's to the end of the last one (not wider)."""
    rng = rng_for("tight chunks", t, s)
    # ids that drift along the row, a few apart in a chunk: chunks far apart do not meet
    drift = lambda n: np.arange(n) // 20 + rng.integers(0, 3, size=(2, n))  # noqa: E731
    q_seg, kv_seg = drift(t), drift(s)
    masks = kernel_masks(2, t, s, None, None, jnp.asarray(q_seg), jnp.asarray(kv_seg))
    for chunks, own, other, other_length in ((masks.q_chunks, q_seg, kv_seg, s), (masks.kv_chunks, kv_seg, q_seg, t)):
        for b in range(2):
            other_spans = _chunk_spans(other[b])
            for c, (low, high) in enumerate(_chunk_spans(own[b])):
                meeting = [j for j, (lo, hi) in enumerate(other_spans) if low <= hi and lo <= high]
                want = (meeting[0] * CHUNK, min((meeting[-1] + 1) * CHUNK, other_length)) if meeting else (0, 0)
                assert tuple(np.asarray(chunks)[b, c, :4]) == (low, high, *want)


def test_packed_documents_skip_other_documents():
    """Four documents of 256 tokens: a query chunk's key range is its own document only."""
    seg = np.repeat(np.arange(4), 256)[None]
    masks = kernel_masks(1, 1024, 1024, None, None, jnp.asarray(seg), jnp.asarray(seg))
    q_chunks = np.asarray(masks.q_chunks)[0]
    for c in range(1024 // CHUNK):
        document = c * CHUNK // 256
        own_document = (256 * document, 256 * (document + 1))
        assert tuple(q_chunks[c]) == (document, document, *own_document, *own_document)


@pytest.mark.parametrize("sorted_ids", [True, False])
def test_one_segment_ranges_are_the_whole_run_of_one_id_chunks(sorted_ids):
    """Against a loop: a chunk of one id gets the other side's chunks of only that id, when they
    are one run (to the end of the keys); a chunk of several ids, or whose id's chunks are not
    one run, gets none."""
    rng = rng_for("one segment", sorted_ids)
    lengths = rng.integers(1, 300, size=12)  # documents of 1-299 tokens: some span chunks, some not
    ids = np.repeat(np.arange(12), lengths)[:1000]
    if not sorted_ids:  # document 0 again after document 20: its chunks are two runs
        ids = np.concatenate([np.repeat([0, 20, 0], [128, 64, 192]), ids + 1])
    t = s = len(ids)
    masks = kernel_masks(1, t, s, None, None, jnp.asarray(ids[None]), jnp.asarray(ids[None]))
    spans = _chunk_spans(ids)
    outcomes = set()
    for chunks in (masks.q_chunks, masks.kv_chunks):
        for c, (low, high) in enumerate(spans):
            run = [j for j, (lo, hi) in enumerate(spans) if lo == hi == low] if low == high else []
            whole_run = bool(run) and run == list(range(run[0], run[-1] + 1))
            want = (run[0] * CHUNK, min((run[-1] + 1) * CHUNK, s)) if whole_run else (0, 0)
            assert tuple(np.asarray(chunks)[0, c, 4:6]) == want
            outcomes.add("several ids" if low != high else "one run" if whole_run else "two runs")
    assert outcomes == ({"several ids", "one run"} if sorted_ids else {"several ids", "one run", "two runs"})


def test_a_segment_with_no_keys_gets_an_empty_range():
    q_seg = np.full((1, 128), 9)
    kv_seg = np.zeros((1, 200), int)
    masks = kernel_masks(1, 128, 200, None, None, jnp.asarray(q_seg), jnp.asarray(kv_seg))
    assert (np.asarray(masks.q_chunks)[0, :, 2:] == 0).all()
    assert (np.asarray(masks.kv_chunks)[0, :, 2:] == 0).all()


def test_lengths_are_clipped_and_absent_inputs_empty():
    masks = kernel_masks(2, 10, 20, jnp.asarray([12, -3]), None, None, None)
    np.testing.assert_array_equal(masks.seqlens, [[10, 20], [0, 20]])
    assert masks.q_segments.shape == (2, 0) and masks.q_chunks.shape == (2, 0, CHUNK_FIELDS)
    assert kernel_masks(2, 10, 20, None, None, None, None).seqlens.shape == (2, 0)
