"""Cost of attention sinks: `python -m jax_flash.bench --sinks`.

gpt-oss's attention (64 query heads over 8 kv heads, d = 64, bf16 on a GPU): its two layer kinds,
a causal window of 128 and full causal, at 4k-32k tokens (one sequence), timed forward and
forward + backward with sinks and without, as the ratio of the two; and its decode steps (T = 1,
batch 1-64, caches of 4k-128k tokens) the same way, on the device's time with a cold cache as
`--decode` times them. On a CPU a small grid checks the machinery. The ratios are medians over
interleaved rounds (the two calls timed back to back each round).
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash.bench import decode
from jax_flash.bench.timing import Shape, measure

HEADS, KV_HEADS, HEAD_DIM = 64, 8, 64  # gpt-oss (20B and 120B)
LAYERS = {"window 128": dict(is_causal=True, local_window_size=(127, 0)), "full causal": dict(is_causal=True)}


def _sinks():
    return jax.random.normal(jax.random.key(5), (HEADS,), jnp.float32)


def training_rows(on_gpu: bool) -> list[dict]:
    seqlens, dtype = ((4096, 8192, 16384, 32768), jnp.bfloat16) if on_gpu else ((128,), jnp.float32)
    heads = HEADS if on_gpu else 8  # on a CPU 8 over 1, the same group of 8
    sinks = _sinks()[:heads]
    rows = []
    for layer, kw in LAYERS.items():
        for seqlen in seqlens:
            shape = Shape(head_dim=HEAD_DIM, seqlen=seqlen, causal=True, batch=1, heads=heads,
                          kv_heads=heads // (HEADS // KV_HEADS))  # fmt: skip
            impls = {"without": lambda q, k, v, causal, kw=kw: jax_flash.attention(q, k, v, **kw),
                     "with sinks": lambda q, k, v, causal, kw=kw: jax_flash.attention(q, k, v, sinks=sinks, **kw)}
            samples = measure(impls, shape, dtype)
            if any(f is None or b is None for rounds in samples.values() for f, b in rounds):
                continue  # failed here: a gap, as in the main table
            (plain, ours) = (samples["without"], samples["with sinks"])
            rows.append({"kind": "training", "layer": layer, "seqlen": seqlen,
                         "fwd": statistics.median(f for f, _ in ours),
                         "fwd_ratio": statistics.median(a[0] / b[0] for a, b in zip(ours, plain)),
                         "fwd_bwd_ratio": statistics.median(sum(a) / sum(b) for a, b in zip(ours, plain))})
    return rows


def decode_rows(on_gpu: bool) -> list[dict]:
    sizes = ((1, 4096), (8, 32768), (64, 4096), (1, 131072)) if on_gpu else ((1, 256),)
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    sinks = _sinks()
    impls = {"without": lambda q, k, v, lengths: jax_flash.attention(q, k, v, is_causal=True,
                                                                     key_value_seq_lengths=lengths),
             "with sinks": lambda q, k, v, lengths: jax_flash.attention(q, k, v, is_causal=True, sinks=sinks,
                                                                        key_value_seq_lengths=lengths)}  # fmt: skip
    rows = []
    for batch, cache in sizes:
        shape = decode.DecodeShape(batch, cache, 1, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
        times = decode.measure(shape, dtype, impls, calls_per_dispatch=decode.CALLS_PER_DISPATCH if on_gpu else 1)
        if None in times.values():
            continue
        rows.append({"kind": "decode", "layer": f"batch {batch}, cache {cache}", "seqlen": cache,
                     "fwd": times["with sinks"], "fwd_ratio": times["with sinks"] / times["without"],
                     "fwd_bwd_ratio": None})
    return rows


def run() -> list[dict]:
    on_gpu = jax.default_backend() == "gpu"
    return training_rows(on_gpu) + decode_rows(on_gpu)


def table(rows: list[dict]) -> str:
    lines = ["| call | tokens | with sinks, fwd ms | fwd: with / without | fwd + bwd: with / without |",
             "|---|---|---|---|---|"]
    for r in rows:
        both = "-" if r["fwd_bwd_ratio"] is None else f"{r['fwd_bwd_ratio']:.3f}"
        lines.append(f"| {r['kind']}: {r['layer']} | {r['seqlen']} | {r['fwd'] * 1e3:.3f} | {r['fwd_ratio']:.3f} | {both} |")
    return "\n".join(lines)
