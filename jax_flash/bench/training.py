"""Benchmark: jax_flash against jax.nn.dot_product_attention (cuDNN and XLA) and, when it
imports, FlashAttention-3's JAX binding, on the same inputs in one run.

    python -m jax_flash.bench [--quick] [--plot out.png] [--head-dims 64 128] [--seqlens 2048 4096]
                              [--json out.json]
    python -m jax_flash.bench --head-dims 320 512 1024 192:128 --heads 8 --batch 1 --seqlens 8192
                              (long head dims, and value head dim 128 under query/key 192)
    python -m jax_flash.bench --masks     (masks and softcap against causal, masks.py)
    python -m jax_flash.bench --ring [--ring-seqlen L]   (ring attention on 2+ GPUs, ring.py)
    python -m jax_flash.bench --decode [--plot out.png]   (decode against a KV cache, decode.py)

The grid is the FlashAttention papers': 16k tokens per batch (batch = 16384 / seqlen), hidden
2048 (heads = 2048 / d), bf16. FLOPs: forward 4·b·h·s²·d, halved when causal; backward 2.5x the
forward (with a value head dim dv: forward 2·b·h·s²·(d + dv), backward 2·b·h·s²·(3d + 2dv)). Each
time is the median of 6 rounds, one wall-clock loop of every implementation a round (10 to 200
calls, about 25 ms), after a warm-up. The rounds interleave the implementations,
ours and the reference back to back, the order reversed every other round, so that a drift of the
clocks during a run, or an advantage of going first, moves both alike. On a GPU each timed loop
starts after a 0.1 s rest (REST_SECONDS says why). Backward = (forward + backward) - forward, per
round. The ratio to the reference column is the median of the 6 rounds' ratios, with their range:
a difference inside that range is noise. On a CPU the grid shrinks and the xla paths are
compared.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from typing import Callable

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash.bench.timing import Shape, measure, peers

def head_dims_arg(text: str) -> tuple[int, int | None]:
    """A --head-dims entry: "128", or "192:128" for query/key head dim 192 and value head dim 128."""
    d, _, dv = text.partition(":")
    try:
        return int(d), int(dv) if dv else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"head dim {text!r}: expected D or D:DV, e.g. 128 or 192:128") from None


def grid(on_gpu: bool, quick: bool, head_dims, seqlens=None, heads=None, batch=None) -> list[Shape]:
    """head_dims: ints or (d, dv) pairs. By default 16k tokens a batch and hidden 2048 (heads =
    2048 / d, at least 1); `heads` and `batch` fix those instead."""
    tokens, hidden = (16384, 2048) if on_gpu else (512, 256)  # on a CPU: CI's time
    if not seqlens and on_gpu:
        seqlens = (1024, 4096) if quick else (512, 1024, 2048, 4096, 8192, 16384)
    elif not seqlens:
        seqlens = (64, 128) if quick else (64, 128, 256)
    if not head_dims:
        head_dims = ((128,) if quick else (64, 128, 256)) if on_gpu else (64,)
    dims = [d if isinstance(d, tuple) else (d, None) for d in head_dims]
    return [
        Shape(d, s, causal, batch or max(1, tokens // s), heads or max(1, hidden // d), dv)
        for d, dv in dims for s in seqlens for causal in (False, True)
    ]  # fmt: skip


def _zero_padded(x, head_dim: int):
    """x [B, S, N, h] with zero columns up to head_dim."""
    return jnp.pad(x, [(0, 0)] * 3 + [(0, head_dim - x.shape[-1])])


def _equal_dims(attn: Callable) -> Callable:
    """attn(q, k, v, causal) for an implementation that takes equal head dims only (jax.nn's): with
    a value head dim other than the query/key one, the narrower side zero-padded to the wider, the
    scale kept at 1/sqrt(query head dim), the output sliced back (exact)."""

    def run(q, k, v, causal):
        d, dv = q.shape[-1], v.shape[-1]
        if d == dv:
            return attn(q, k, v, causal)
        q, k, v = (_zero_padded(x, max(d, dv)) for x in (q, k, v))
        return attn(q, k, v, causal, scale=d**-0.5)[..., :dv]

    return run


def _value_padded(q, k, v, causal):
    """jax_flash with the value zero-padded to the query/key head dim (where it is narrower): what
    a call with unequal head dims would cost without kernels of its own. Equal dims: no column."""
    d, dv = q.shape[-1], v.shape[-1]
    if dv >= d:
        raise ValueError("the padded column is for a value head dim below the query/key one")
    return jax_flash.attention(q, k, _zero_padded(v, d), is_causal=causal)[..., :dv]


def implementations(on_gpu: bool) -> dict[str, Callable]:
    """name -> attention(q, k, v, causal) for every implementation that runs here."""

    def jax_nn(implementation: str) -> Callable:
        return _equal_dims(lambda q, k, v, c, **kw: jax.nn.dot_product_attention(
            q, k, v, is_causal=c, implementation=implementation, **kw))  # fmt: skip

    # Ours and the reference column first, next to each other in the timing order (measure).
    impls = {"jax_flash": lambda q, k, v, c: jax_flash.attention(q, k, v, is_causal=c)}
    if on_gpu:
        impls["cudnn"] = jax_nn("cudnn")
    for name, attn in peers(on_gpu).items():
        if name != "cudnn":
            impls[name] = lambda q, k, v, c, attn=attn: attn(q, k, v, is_causal=c)
    impls["xla"] = jax_nn("xla")
    impls["jax_flash, V padded"] = _value_padded
    return impls


def run(args) -> list[dict]:
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    impls = implementations(on_gpu)
    base = "cudnn" if "cudnn" in impls else "xla"
    shapes = grid(on_gpu, args.quick, args.head_dims, args.seqlens, args.heads, args.batch)
    if not any(shape.dv < shape.head_dim for shape in shapes):
        del impls["jax_flash, V padded"]
    rows = []
    progress = _progress(len(shapes))
    for shape in shapes:
        samples = measure(impls, shape, dtype)
        for name, per_round in samples.items():
            for i, pass_ in enumerate(("fwd", "bwd")):
                times = [r[i] for r in per_round]
                t = None if None in times else statistics.median(times)
                tflops = None if t is None else shape.flops(pass_ == "bwd") / t / 1e12
                ref = [r[i] for r in samples[base]]
                # Ours against the reference, round by round (each pair timed back to back).
                ratios = None if t is None or None in ref else [b / a for a, b in zip(times, ref)]
                rows.append({**dataclasses.asdict(shape), "d": shape.label, "pass": pass_, "impl": name, "seconds": t,
                             "tflops": tflops, f"vs_{base}_rounds": ratios})
        progress(f"d={shape.label} s={shape.seqlen} causal={shape.causal}")
    return rows


def _progress(total: int):
    try:
        from tqdm import tqdm

        bar = tqdm(total=total, file=sys.stderr)

        def step(label):
            bar.set_description(label)
            bar.update()
            if bar.n == total:
                bar.close()
    except ImportError:
        count = [0]

        def step(label):
            count[0] += 1
            print(f"[{count[0]}/{total}] {label}", file=sys.stderr, flush=True)

    return step


def table(rows: list[dict]) -> str:
    """One line per (d, seqlen, causal, pass): TFLOP/s per implementation and our ratio to the
    reference column (cuDNN on a GPU, jax.nn xla elsewhere): the median of the rounds' ratios and
    their range."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    base = "cudnn" if "cudnn" in impls else "xla"
    keyed, ratios = {}, {}
    for r in rows:
        key = (r["d"], r["seqlen"], r["causal"], r["pass"])
        keyed.setdefault(key, {})[r["impl"]] = r["tflops"]
        if r["impl"] == "jax_flash":
            ratios[key] = r.get(f"vs_{base}_rounds")
    header = f"| d | seqlen | causal | pass | {' | '.join(impls)} | jax_flash / {base} (range) |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    fmt = lambda x: "—" if x is None else f"{x:.0f}" if x >= 10 else f"{x:.2f}"  # noqa: E731
    for key, values in keyed.items():
        d, s, causal, pass_ = key
        rounds = ratios.get(key)
        ratio = f"{statistics.median(rounds):.2f} ({min(rounds):.2f}–{max(rounds):.2f})" if rounds else "—"
        cells = " | ".join(fmt(values.get(i)) for i in impls)
        lines.append(f"| {d} | {s} | {'yes' if causal else 'no'} | {pass_} | {cells} | {ratio} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r["d"], r["causal"], r["pass"]) for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), squeeze=False)
    for ax, (d, causal, pass_) in zip(axes[0], panels):
        for impl in dict.fromkeys(r["impl"] for r in rows):
            pts = sorted((r["seqlen"], r["tflops"]) for r in rows if r["impl"] == impl and r["d"] == d
                         and r["causal"] == causal and r["pass"] == pass_ and r["tflops"] is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{pass_} d={d}{' causal' if causal else ''}", fontsize=9)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"attention, {jax.devices()[0].device_kind}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
