"""A serving step's ragged batch: `python -m jax_flash.bench --ragged`.

One step of continuous batching (32 query heads over 8 kv heads, d = 128, bf16 on a GPU): 4 prefill
chunks of 512-2048 tokens beside 60 decodes over caches of 1k-32k tokens, all in one pool of
shuffled pages of 16 or 64 tokens, run as one `jax_flash.ragged_paged_attention` call against the
best separate calls on the same work: `jax_flash.paged_attention` for the decodes (T = 1, the
pages in place) and jax_flash's forward for each prefill chunk over its cache as a dense array
(no gather counted). Also the decodes alone and the prefills alone, each against its separate
calls. Times are the device's (from the profiler: first kernel to last of one dispatch, the
host's work excluded) on a GPU, the wall clock elsewhere, medians over interleaved rounds. The
caches (4.5 GB at pages of 16) are far beyond the L2: every call reads them cold. On a CPU a
small step checks the machinery.
"""

from __future__ import annotations

import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash.bench import decode

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
PREFILLS = ((512, 2048), (1024, 4096), (1536, 8192), (2048, 2048))  # (chunk, cache with the chunk)
DECODES = tuple(int(c) for c in np.geomspace(1024, 32768, 60))


@dataclasses.dataclass(frozen=True)
class Step:
    kind: str  # "mixed", "decodes" or "prefills"
    prefills: tuple  # (chunk, cache) pairs
    decodes: tuple  # cache lengths, one query each
    page_size: int
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM


def grid(on_gpu: bool) -> list[Step]:
    if not on_gpu:
        return [Step("mixed", ((8, 24),), (5, 40, 17), 16, heads=4, kv_heads=2, head_dim=32)]
    return [Step(kind, PREFILLS if kind != "decodes" else (), DECODES if kind != "prefills" else (), page_size)
            for page_size in (16, 64) for kind in ("mixed", "decodes", "prefills")]  # fmt: skip


def problem(step: Step, dtype, seed: int = 0):
    """(ragged arguments, separate calls' arguments) of one step, on random values."""
    rng = np.random.default_rng(seed)
    caches = [c for _, c in step.prefills] + list(step.decodes)
    chunks = [q for q, _ in step.prefills] + [1] * len(step.decodes)
    page = step.page_size
    pages_of = [-(-c // page) for c in caches]
    max_pages = max(pages_of)
    pool = sum(pages_of)
    order = rng.permutation(pool)
    table = np.zeros((len(caches), max_pages), np.int32)
    used = 0
    for i, n in enumerate(pages_of):
        table[i, :n] = order[used:used + n]
        used += n
    key = jax.random.key(seed)
    k_pool, v_pool, q = (jax.random.normal(k, shape, dtype) for k, shape in zip(
        jax.random.split(key, 3), [(pool, page, step.kv_heads, step.head_dim)] * 2 +
        [(sum(chunks), step.heads, step.head_dim)]))  # fmt: skip
    starts = jnp.asarray(np.concatenate([[0], np.cumsum(chunks)]), jnp.int32)
    lengths, table = jnp.asarray(caches, jnp.int32), jnp.asarray(table)
    ragged_args = (q, k_pool, v_pool, lengths, table, starts)
    # The separate calls: each prefill's chunk and its cache as dense arrays; the decodes' queries,
    # lengths and page table rows over the same pool.
    prefills = []
    for i, (chunk, cache) in enumerate(step.prefills):
        dense = [jnp.take(x, table[i, :pages_of[i]], axis=0).reshape(1, -1, step.kv_heads, step.head_dim)[:, :cache]
                 for x in (k_pool, v_pool)]  # fmt: skip
        prefills.append((q[None, int(starts[i]):int(starts[i + 1])], *dense))
    d0 = len(step.prefills)
    decodes = (q[int(starts[d0]):, None], k_pool, v_pool, lengths[d0:], table[d0:]) if step.decodes else None
    return ragged_args, (prefills, decodes)


def _separate(prefills, decodes):
    outs = [jax_flash.attention(q, k, v, is_causal=True) for q, k, v in prefills]
    if decodes is not None:
        q, k_pool, v_pool, lengths, table = decodes
        outs.append(jax_flash.paged_attention(q, k_pool, v_pool, lengths, table, is_causal=True))
    return outs


def measure(step: Step, dtype, rounds: int = 6) -> dict[str, float]:
    """{"ragged", "separate"} -> seconds per step (median of interleaved rounds)."""
    ragged_args, separate_args = problem(step, dtype)
    fns = {"ragged": (jax.jit(jax_flash.ragged_paged_attention), ragged_args),
           "separate": (jax.jit(_separate), separate_args)}  # fmt: skip
    for fn, args in fns.values():
        jax.block_until_ready(fn(*args))  # compile and warm up
    order = [name for r in range(rounds) for name in (list(fns) if r % 2 == 0 else list(fns)[::-1])]
    if jax.default_backend() == "gpu":
        seconds = decode._device_seconds([lambda name=name: fns[name][0](*fns[name][1]) for name in order])
    else:
        seconds = [decode._wall_seconds(*fns[name]) for name in order]
    return {name: statistics.median(s for n, s in zip(order, seconds) if n == name) for name in fns}


def run() -> list[dict]:
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    rows = []
    for step in grid(on_gpu):
        times = measure(step, dtype)
        rows.append({"kind": step.kind, "page_size": step.page_size, "prefills": len(step.prefills),
                     "decodes": len(step.decodes), **times, "ratio": times["ragged"] / times["separate"]})
    return rows


SEPARATE = {"mixed": "decode + forwards", "decodes": "paged_attention", "prefills": "forwards"}


def table(rows: list[dict]) -> str:
    lines = ["| step | page | ragged ms | separate calls | separate ms | ragged / separate |", "|---|---|---|---|---|---|"]
    for r in rows:
        what = f"{r['kind']} ({r['prefills']} prefills, {r['decodes']} decodes)"
        lines.append(f"| {what} | {r['page_size']} | {r['ragged'] * 1e3:.3f} | {SEPARATE[r['kind']]} | "
                     f"{r['separate'] * 1e3:.3f} | {r['ratio']:.3f} |")
    return "\n".join(lines)
