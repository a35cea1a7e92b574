"""Benchmark: jax_flash against jax.nn.dot_product_attention (cuDNN and XLA) and, when it
imports, FlashAttention-3's JAX binding, on the same inputs in one run.

    python -m jax_flash.bench [--quick] [--plot out.png] [--head-dims 64 128] [--seqlens 2048 4096]
                              [--json out.json]
    python -m jax_flash.bench --masks     (masks and softcap against causal, bench_masks.py)
    python -m jax_flash.bench --ring [--ring-seqlen L]   (ring attention on 2+ GPUs, bench_ring.py)

The grid is the FlashAttention papers': 16k tokens per batch (batch = 16384 / seqlen), hidden
2048 (heads = 2048 / d), bf16. FLOPs: forward 4·b·h·s²·d, halved when causal; backward 2.5x the
forward. Each time is the median of 5 wall-clock loops of 10 calls after a warm-up; backward =
(forward + backward) - forward. On a CPU the grid shrinks and the xla paths are compared.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp

import jax_flash


@dataclasses.dataclass(frozen=True)
class Shape:
    head_dim: int
    seqlen: int
    causal: bool
    batch: int
    heads: int

    def flops(self, backward: bool) -> float:
        f = 4.0 * self.batch * self.heads * self.seqlen**2 * self.head_dim
        f = f / 2 if self.causal else f
        return 2.5 * f if backward else f


def grid(on_gpu: bool, quick: bool, head_dims, seqlens=None) -> list[Shape]:
    tokens, hidden = (16384, 2048) if on_gpu else (1024, 256)
    if not seqlens and on_gpu:
        seqlens = (1024, 4096) if quick else (512, 1024, 2048, 4096, 8192, 16384)
    elif not seqlens:
        seqlens = (128, 256) if quick else (128, 256, 512)
    if not head_dims:
        head_dims = ((128,) if quick else (64, 128, 256)) if on_gpu else (64,)
    return [
        Shape(d, s, causal, max(1, tokens // s), hidden // d)
        for d in head_dims for s in seqlens for causal in (False, True)
    ]  # fmt: skip


def implementations(on_gpu: bool) -> dict[str, Callable]:
    """name -> attention(q, k, v, causal) for every implementation that runs here."""
    impls = {
        "jax_flash": lambda q, k, v, c: jax_flash.attention(q, k, v, is_causal=c),
        "xla": lambda q, k, v, c: jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation="xla"),
    }  # fmt: skip
    if on_gpu:
        impls["cudnn"] = lambda q, k, v, c: jax.nn.dot_product_attention(
            q, k, v, is_causal=c, implementation="cudnn")
        try:
            from flash_attn3_jax import flash_mha  # optional peer, never a dependency

            impls["fa3_jax"] = lambda q, k, v, c: flash_mha(q, k, v, is_causal=c)
        except ImportError:
            pass
    return impls


def _median_loop_seconds(fn, args, loops: int = 5, calls: int = 10) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(loops):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def fwd_and_fwd_bwd_seconds(attn: Callable, args) -> tuple[float, float]:
    """Seconds of attn(q, k, v) and of its forward + backward (the vjp of do), args = (q, k, v, do)."""

    def fwd_bwd(q, k, v, do):
        _, vjp = jax.vjp(attn, q, k, v)
        return vjp(do)

    return _median_loop_seconds(jax.jit(attn), tuple(args[:3])), _median_loop_seconds(jax.jit(fwd_bwd), tuple(args))


def measure(attn: Callable, shape: Shape, dtype) -> tuple[float | None, float | None]:
    """(forward seconds, backward seconds); None where the implementation fails on this shape."""
    keys = jax.random.split(jax.random.key(shape.seqlen * 7 + shape.head_dim), 4)
    dims = (shape.batch, shape.seqlen, shape.heads, shape.head_dim)
    q, k, v, do = (jax.random.normal(key, dims, dtype) for key in keys)
    fwd = jax.jit(lambda q, k, v: attn(q, k, v, shape.causal))

    def fwd_bwd(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, shape.causal), q, k, v)
        return vjp(do)

    try:
        t_fwd = _median_loop_seconds(fwd, (q, k, v))
    except Exception:  # unsupported shape or out of memory: a gap in the table, not a crash
        return None, None
    try:
        t_both = _median_loop_seconds(jax.jit(fwd_bwd), (q, k, v, do))
    except Exception:
        return t_fwd, None
    return t_fwd, max(t_both - t_fwd, 1e-9)


def run(args) -> list[dict]:
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    impls = implementations(on_gpu)
    shapes = grid(on_gpu, args.quick, args.head_dims, args.seqlens)
    rows = []
    progress = _progress(len(shapes) * len(impls))
    for shape in shapes:
        for name, attn in impls.items():
            t_fwd, t_bwd = measure(attn, shape, dtype)
            for backward, t in ((False, t_fwd), (True, t_bwd)):
                tflops = None if t is None else shape.flops(backward) / t / 1e12
                rows.append({**dataclasses.asdict(shape), "pass": "bwd" if backward else "fwd",
                             "impl": name, "seconds": t, "tflops": tflops})
            progress(f"d={shape.head_dim} s={shape.seqlen} causal={shape.causal} {name}")
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
    reference column (cuDNN on a GPU, jax.nn xla elsewhere)."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    base = "cudnn" if "cudnn" in impls else "xla"
    keyed = {}
    for r in rows:
        keyed.setdefault((r["head_dim"], r["seqlen"], r["causal"], r["pass"]), {})[r["impl"]] = r["tflops"]
    header = f"| d | seqlen | causal | pass | {' | '.join(impls)} | jax_flash / {base} |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    fmt = lambda x: "—" if x is None else f"{x:.0f}" if x >= 10 else f"{x:.2f}"  # noqa: E731
    for (d, s, causal, pass_), values in keyed.items():
        ours, ref = values.get("jax_flash"), values.get(base)
        ratio = f"{ours / ref:.2f}" if ours and ref else "—"
        cells = " | ".join(fmt(values.get(i)) for i in impls)
        lines.append(f"| {d} | {s} | {'yes' if causal else 'no'} | {pass_} | {cells} | {ratio} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["head_dim"], r["causal"], r["pass"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), squeeze=False)
    for ax, (d, causal, pass_) in zip(axes[0], panels):
        for impl in dict.fromkeys(r["impl"] for r in rows):
            pts = sorted((r["seqlen"], r["tflops"]) for r in rows if r["impl"] == impl and r["head_dim"] == d
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


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m jax_flash.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short grid")
    parser.add_argument("--head-dims", type=int, nargs="+", help="head dims to run (GPU grid)")
    parser.add_argument("--seqlens", type=int, nargs="+", help="sequence lengths to run")
    parser.add_argument("--plot", metavar="PNG", help="write TFLOP/s vs seqlen per implementation")
    parser.add_argument("--json", metavar="FILE", help="write every measurement as JSON")
    parser.add_argument("--masks", action="store_true", help="time masks and the soft cap against causal instead")
    parser.add_argument("--ring", action="store_true", help="time ring attention over every GPU instead")
    parser.add_argument("--ring-seqlen", type=int, default=32768, help="tokens per device for --ring")
    args = parser.parse_args(argv)
    if args.ring:
        from jax_flash import bench_ring

        rows = bench_ring.run(args.ring_seqlen)
        print(f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind}, jax {jax.__version__}, "
              f"{args.ring_seqlen} tokens per device, 16 heads, d = 128, bf16")
        print(bench_ring.table(rows))
        return rows
    if args.masks:
        from jax_flash import bench_masks

        rows = bench_masks.run()
        print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, d = 128")
        print(bench_masks.table(rows))
        return rows
    rows = run(args)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, TFLOP/s")
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
