"""Decode against a KV cache: `python -m jax_flash.bench --decode`.

A generation step's attention: T = 1 or 4 new queries of each sequence (32 query heads over 8 kv
heads, d = 128, bf16) against a cache of S tokens, for a grid of batch x cache length; jax_flash
(`is_causal=True` with the cache length as `key_value_seq_lengths`), `jax_flash.paged_attention`
on the same bytes in shuffled pages of 64 and 16 tokens, cuDNN and XLA through
`jax.nn.dot_product_attention` (without a mask: one query sees every key; at T = 4 the causal
corner is 6 logits of the cache's thousands, so the work is the same), on the same inputs in one
run. On a CPU a small grid compares jax_flash with XLA. With `--kv-dtype fp8` also jax_flash's
fp8 caches (float8_e4m3fn, one scale for keys and one for values): dense and pages of 64, their
fraction of HBM counting the bytes they read (one a value).

Decode is memory-bound: the figure is the K and V bytes read over the time, as a fraction of the
device's HBM peak (`hbm_peak`: the H200's 4.8 TB/s, the H100 SXM's 3.35). Two things would
distort it and are kept out:
  - the L2 cache (50 MB on an H100 or H200), which holds a small cache between calls: the calls cycle
    through copies of the cache, as many as make 200 MB;
  - the host: 32 or more calls (other queries, the copies) run inside one jitted function, and on
    a GPU the time is the device's, from the profiler: the span from the dispatch's first kernel
    to its last, over the calls. The gaps between kernels on the GPU count (a generation step has
    them); the host's work before and between launches does not. At small caches that host work
    (XLA launching each call, or updating its CUDA graph) takes longer than the kernels, so a wall
    clock would time the host, the same for every implementation.
Each time is the median of interleaved rounds, as in the main benchmark.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import _device

COLD_BYTES = 200 * 2**20  # copies of the cache read per timed call: 4x the H100's L2
CALLS_PER_DISPATCH = 32  # calls per timed jitted call, each on other queries: the dispatch shrinks to 1/32
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
FP8 = jnp.float8_e4m3fn
# The fp8 caches' scale: normal keys and values over it stay within e4m3's 448 (5.8 sigma).
FP8_SCALE = 1 / 64


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    batch: int
    cache: int
    queries: int
    heads: int = HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM

    def kv_bytes(self, dtype) -> int:
        return 2 * self.batch * self.cache * self.kv_heads * self.head_dim * jnp.dtype(dtype).itemsize


def grid(on_gpu: bool) -> list[DecodeShape]:
    sizes = ((1, 1024), (1, 8192), (8, 8192), (8, 32768), (64, 4096), (1, 131072)) if on_gpu else ((1, 256), (2, 1024))
    return [DecodeShape(b, s, t) for b, s in sizes for t in (1, 4)]


def _paged(page_size: int):
    """jax_flash.paged_attention on the same bytes: the cache cut into pages of `page_size` tokens,
    the page table a fixed shuffle of them (so that a sequence's pages lie anywhere in the pool)."""

    def attend(q, k, v, lengths, **scales):
        b, s = k.shape[:2]
        pages = b * s // page_size
        table = jnp.asarray(np.random.default_rng(0).permutation(pages).reshape(b, s // page_size), jnp.int32)
        pool = lambda x: x.reshape(pages, page_size, *x.shape[2:])  # noqa: E731
        return jax_flash.paged_attention(q, pool(k), pool(v), lengths, table, is_causal=True, **scales)

    return attend


def _fp8(attend):
    """`attend` over fp8 caches (cache_dtype: the names end in "fp8"), scaled by FP8_SCALE."""
    return lambda q, k, v, lengths: attend(q, k, v, lengths, key_scale=FP8_SCALE, value_scale=FP8_SCALE)


def cache_dtype(name: str, dtype):
    """The dtype of the cache that implementation `name` reads."""
    return FP8 if name.endswith("fp8") else dtype


def implementations(on_gpu: bool, kv_dtype: str = "model") -> dict:
    """name -> attention(q, k, v, lengths) for a decode step."""
    def ours(q, k, v, lengths, **scales):
        return jax_flash.attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths, **scales)

    impls = {"jax_flash": ours}
    impls["paged 64"], impls["paged 16"] = _paged(64), _paged(16)
    if kv_dtype == "fp8":
        impls["jax_flash fp8"], impls["paged 64 fp8"] = _fp8(ours), _fp8(_paged(64))
    if on_gpu:
        impls["cudnn"] = lambda q, k, v, lengths: jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=lengths, implementation="cudnn")  # fmt: skip
    impls["xla"] = lambda q, k, v, lengths: jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=lengths, implementation="xla")  # fmt: skip
    return impls


def _over_copies(attn):
    """One jitted call running `attn` once for each (query set, copy of the cache) pair: each call
    reads its copy cold, and one dispatch covers them all. The outputs are returned as they are
    (a sum would add a kernel a call). Each call's operands pass an optimization barrier, so that
    XLA cannot merge the calls that share a copy into one pass over it."""

    def run(lengths, queries, caches):
        return [attn(*jax.lax.optimization_barrier((q, k, v)), lengths) for q in queries for k, v in caches]

    return jax.jit(run)


def _wall_seconds(fn, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


DISPATCH_GAP_US = 20_000  # idle GPU time that separates two timed dispatches in a trace


def dispatch_spans(trace_events: list[dict], dispatches: int) -> list[float]:
    """Seconds from the first GPU event of each dispatch to the end of its last, in a profiler
    trace (Chrome trace events) of `dispatches` dispatches run one after another with the GPU idle
    in between."""
    gpu = {e["pid"] for e in trace_events if e.get("ph") == "M" and e.get("name") == "process_name"
           and "GPU" in e["args"]["name"]}  # fmt: skip
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in trace_events if e.get("ph") == "X" and e["pid"] in gpu)
    groups = []  # [start, end] of each dispatch, split where the GPU idled
    for start, end in spans:
        if groups and start - groups[-1][1] < DISPATCH_GAP_US:
            groups[-1][1] = max(groups[-1][1], end)
        else:
            groups.append([start, end])
    if len(groups) != dispatches:
        raise RuntimeError(f"the trace holds {len(groups)} dispatches, not {dispatches}")
    return [(end - start) * 1e-6 for start, end in groups]


def _device_seconds(dispatches: list) -> list[float]:
    """Runs each dispatch (a no-argument function) once, 0.1 s apart, under the profiler, and
    returns the GPU time of each (dispatch_spans)."""
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for dispatch in dispatches:
                time.sleep(0.1)
                jax.block_until_ready(dispatch())
        (path,) = glob.glob(f"{folder}/**/perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    return dispatch_spans(trace["traceEvents"] if isinstance(trace, dict) else trace, len(dispatches))


def measure(shape: DecodeShape, dtype, impls: dict, rounds: int = 6, calls_per_dispatch: int = CALLS_PER_DISPATCH,
            ) -> dict[str, float | None]:  # fmt: skip
    """name -> seconds per decode call (None where the implementation fails on this shape): the
    GPU's time on a GPU, else the wall clock's."""
    # Copies of the cache that make each call read it cold from HBM; on a CPU one (the timing
    # there checks the machinery, and 64 copies made the CPU test compile for a minute).
    on_gpu = jax.default_backend() == "gpu"
    copies = max(1, min(64, -(-COLD_BYTES // shape.kv_bytes(dtype)))) if on_gpu else 1
    query_sets = -(-calls_per_dispatch // copies)
    keys = jax.random.split(jax.random.key(shape.batch * 31 + shape.cache + shape.queries), 2 * copies + query_sets)
    kv_shape = (shape.batch, shape.cache, shape.kv_heads, shape.head_dim)
    caches = [(jax.random.normal(keys[2 * i], kv_shape, dtype), jax.random.normal(keys[2 * i + 1], kv_shape, dtype))
              for i in range(copies)]  # fmt: skip
    if any(cache_dtype(name, dtype) == FP8 for name in impls):
        fp8_caches = [tuple((x.astype(jnp.float32) / FP8_SCALE).astype(FP8) for x in pair) for pair in caches]
    q_shape = (shape.batch, shape.queries, shape.heads, shape.head_dim)
    queries = [jax.random.normal(key, q_shape, dtype) for key in keys[2 * copies :]]
    lengths = jnp.full((shape.batch,), shape.cache, jnp.int32)
    args_of = {name: (lengths, queries, fp8_caches if cache_dtype(name, dtype) == FP8 else caches) for name in impls}
    calls = len(queries) * copies
    runs = {}
    for name, attn in impls.items():
        try:
            fn = _over_copies(attn)
            jax.block_until_ready(fn(*args_of[name]))  # compile and warm up
            runs[name] = fn
        except Exception:  # unsupported here: a gap in the table, not a crash
            runs[name] = None
    order = [name for round_ in range(rounds) for name in (list(impls) if round_ % 2 == 0 else list(impls)[::-1])
             if runs[name] is not None]  # fmt: skip
    if on_gpu:
        seconds = _device_seconds([lambda fn=runs[name], args=args_of[name]: fn(*args) for name in order])
    else:
        seconds = [_wall_seconds(runs[name], args_of[name]) for name in order]
    samples = {name: [] for name in impls}
    for name, s in zip(order, seconds):
        samples[name].append(s / calls)
    return {name: statistics.median(s) if s else None for name, s in samples.items()}


def run(kv_dtype: str = "model") -> list[dict]:
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    impls = implementations(on_gpu, kv_dtype)
    rows = []
    for shape in grid(on_gpu):
        times = measure(shape, dtype, impls, calls_per_dispatch=CALLS_PER_DISPATCH if on_gpu else 1)
        for name, seconds in times.items():
            rate = None if seconds is None else shape.kv_bytes(cache_dtype(name, dtype)) / seconds
            rows.append({**dataclasses.asdict(shape), "impl": name, "seconds": seconds, "bytes_per_second": rate})
    return rows


hbm_peak = _device.hbm_peak  # the denominator of the table's fraction


def table(rows: list[dict]) -> str:
    """One line per (batch, cache, T): microseconds per step and fraction of HBM peak for each
    implementation, and jax_flash's speed over the reference (cuDNN on a GPU, XLA elsewhere)."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    peak = hbm_peak()[1]
    base = "cudnn" if "cudnn" in impls else "xla"
    by_shape = {}
    for r in rows:
        by_shape.setdefault((r["batch"], r["cache"], r["queries"]), {})[r["impl"]] = r
    cells = " | ".join(f"{name} µs (HBM)" for name in impls)
    lines = [f"| batch | cache | T | {cells} | {base} / jax_flash |", "|" + "---|" * (4 + len(impls))]
    for (b, s, t), found in by_shape.items():
        row = []
        for name in impls:
            r = found[name]
            row.append("—" if r["seconds"] is None else
                       f"{r['seconds'] * 1e6:.1f} ({r['bytes_per_second'] / peak:.0%})")
        ours, ref = found["jax_flash"]["seconds"], found[base]["seconds"]
        ratio = "—" if ours is None or ref is None else f"{ref / ours:.2f}"
        lines.append(f"| {b} | {s} | {t} | {' | '.join(row)} | {ratio} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """Fraction of HBM peak per (batch, cache, T), one bar per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = list(dict.fromkeys(r["impl"] for r in rows))
    shapes = list(dict.fromkeys((r["batch"], r["cache"], r["queries"]) for r in rows))
    fraction = {(r["batch"], r["cache"], r["queries"], r["impl"]): r["bytes_per_second"] for r in rows}
    peak_name, peak = hbm_peak()
    fig, ax = plt.subplots(figsize=(1.2 * len(shapes) + 2, 3.6))
    width = 0.8 / len(impls)
    for i, name in enumerate(impls):
        values = [(fraction[(*s, name)] or 0) / peak for s in shapes]
        ax.bar([x + i * width for x in range(len(shapes))], values, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))])
    ax.set_xticklabels([f"{b}x{s // 1024}k\nT={t}" for b, s, t in shapes], fontsize=8)
    ax.set_ylabel(f"K, V bytes / time, fraction of HBM peak\n({peak_name})", fontsize=8)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"decode, {jax.devices()[0].device_kind}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
