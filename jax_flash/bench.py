"""Benchmark: jax_flash against jax.nn.dot_product_attention (cuDNN and XLA) and, when it
imports, FlashAttention-3's JAX binding, on the same inputs in one run.

    python -m jax_flash.bench [--quick] [--plot out.png] [--head-dims 64 128] [--seqlens 2048 4096]
                              [--json out.json]
    python -m jax_flash.bench --masks     (masks and softcap against causal, bench_masks.py)
    python -m jax_flash.bench --ring [--ring-seqlen L]   (ring attention on 2+ GPUs, bench_ring.py)
    python -m jax_flash.bench --decode [--plot out.png]   (decode against a KV cache, bench_decode.py)

The grid is the FlashAttention papers': 16k tokens per batch (batch = 16384 / seqlen), hidden
2048 (heads = 2048 / d), bf16. FLOPs: forward 4·b·h·s²·d, halved when causal; backward 2.5x the
forward. Each time is the median of 6 rounds, one wall-clock loop of every implementation a
round (10 to 200 calls, about 25 ms), after a warm-up. The rounds interleave the implementations,
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


def peers(on_gpu: bool) -> dict[str, Callable]:
    """name -> attention(q, k, v, is_causal, local_window_size=None) of each peer that runs here:
    on a GPU cuDNN and, when it imports, FlashAttention-3's JAX binding."""
    if not on_gpu:
        return {}
    found = {"cudnn": lambda q, k, v, is_causal, local_window_size=None: jax.nn.dot_product_attention(
        q, k, v, is_causal=is_causal, local_window_size=local_window_size, implementation="cudnn")}
    try:
        from flash_attn3_jax import flash_mha  # optional peer, never a dependency

        found["fa3_jax"] = lambda q, k, v, is_causal, local_window_size=None: flash_mha(
            q, k, v, is_causal=is_causal, window_size=local_window_size or (-1, -1))
    except ImportError:
        pass
    return found


def implementations(on_gpu: bool) -> dict[str, Callable]:
    """name -> attention(q, k, v, causal) for every implementation that runs here."""
    # Ours and the reference column first, next to each other in the timing order (measure).
    impls = {"jax_flash": lambda q, k, v, c: jax_flash.attention(q, k, v, is_causal=c)}
    for name, attn in peers(on_gpu).items():
        impls[name] = lambda q, k, v, c, attn=attn: attn(q, k, v, is_causal=c)
    impls["xla"] = lambda q, k, v, c: jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation="xla")
    return impls


# Even: ours and the reference are each timed first in half of the rounds. Which of the two went
# first moved their ratio by 5-15% on the H100 (2026-11-23), an untimed loop before each timed one
# included, so neither may go first more often.
ROUNDS = 6
LOOP_SECONDS = 0.025
# The GPU's idle time before every timed loop. Under these kernels the H100 sits at its power cap
# (700 W, clocks down to ~1.5 GHz), and a loop's clocks then depend on the power drawn just before:
# right after another implementation's loop, a loop ran 3-20% slower than after a rest, by an
# amount that depended on that neighbour (2026-11-24: FlashAttention-3's forward at d = 128, 16k
# took 3.74 ms after ours, 3.60 after cuDNN's, 3.29 after 0.1 s idle). From 0.1 s on, every
# loop's time was the same whatever ran before (within 1%), and the same as after 0.5 s.
REST_SECONDS = 0.1


def _loop_seconds(fn, args, calls: int = 10) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls


def rested_loop_seconds(fn, args, calls: int = 10) -> float:
    """_loop_seconds, after REST_SECONDS idle on a GPU."""
    if jax.default_backend() == "gpu":
        time.sleep(REST_SECONDS)
    return _loop_seconds(fn, args, calls)


def _median_loop_seconds(fn, args, loops: int = ROUNDS, calls: int = 10) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    return statistics.median(_loop_seconds(fn, args, calls) for _ in range(loops))


def _jitted_fwd_and_fwd_bwd(attn: Callable) -> tuple[Callable, Callable]:
    """attn(q, k, v) and its forward + backward (q, k, v, do) -> the vjp of do, each jitted."""

    def fwd_bwd(q, k, v, do):
        _, vjp = jax.vjp(attn, q, k, v)
        return vjp(do)

    return jax.jit(attn), jax.jit(fwd_bwd)


def fwd_and_fwd_bwd_seconds(attn: Callable, args) -> tuple[float, float]:
    """Seconds of attn(q, k, v) and of its forward + backward (the vjp of do), args = (q, k, v, do)."""
    fwd, fwd_bwd = _jitted_fwd_and_fwd_bwd(attn)
    return _median_loop_seconds(fwd, tuple(args[:3])), _median_loop_seconds(fwd_bwd, tuple(args))


def _warmed(fn: Callable, args) -> Callable | None:
    """fn, compiled and run once; None where the implementation fails on these inputs."""
    try:
        jax.block_until_ready(fn(*args))
    except Exception:  # unsupported shape or out of memory: a gap in the table, not a crash
        return None
    return fn


def _calls_per_loop(fn, args, seconds: float = LOOP_SECONDS) -> int:
    """Calls that make one timed loop last about `seconds` (at least 10, at most 200), so that a
    host hiccup or a clock step is a small part of every loop, short kernels included."""
    once = _loop_seconds(fn, args, calls=3)
    return max(10, min(200, int(seconds / max(once, 1e-9)) + 1))


def measure(impls: dict[str, Callable], shape: Shape, dtype, rounds: int = ROUNDS) -> dict[str, list]:
    """name -> [(forward seconds, backward seconds) per round], every implementation timed once a
    round on the same inputs; None where it fails on this shape. Within a round the forward loops
    run in the order of impls and the forward + backward loops in the reverse order, and odd rounds
    reverse both, so that the first two implementations (ours and the reference) are always timed
    back to back and a drift of the clocks during a round favours neither."""
    keys = jax.random.split(jax.random.key(shape.seqlen * 7 + shape.head_dim), 4)
    dims = (shape.batch, shape.seqlen, shape.heads, shape.head_dim)
    q, k, v, do = (jax.random.normal(key, dims, dtype) for key in keys)
    fwd_args, fwd_bwd_args = (q, k, v), (q, k, v, do)
    loops = {}  # name -> (fwd, calls, fwd_bwd, calls); fwd or fwd_bwd None where it fails
    for name, attn in impls.items():
        fwd, fwd_bwd = _jitted_fwd_and_fwd_bwd(lambda q, k, v, attn=attn: attn(q, k, v, shape.causal))
        fwd = _warmed(fwd, fwd_args)
        fwd_bwd = _warmed(fwd_bwd, fwd_bwd_args) if fwd else None
        loops[name] = (fwd, fwd and _calls_per_loop(fwd, fwd_args),
                       fwd_bwd, fwd_bwd and _calls_per_loop(fwd_bwd, fwd_bwd_args))
    samples = {name: [] for name in impls}
    for round_ in range(rounds):
        order = list(impls) if round_ % 2 == 0 else list(impls)[::-1]
        t_fwd, t_fwd_bwd = {}, {}
        for name in order:
            fwd, calls, _, _ = loops[name]
            t_fwd[name] = rested_loop_seconds(fwd, fwd_args, calls) if fwd else None
        for name in order[::-1]:
            _, _, fwd_bwd, calls = loops[name]
            t_fwd_bwd[name] = rested_loop_seconds(fwd_bwd, fwd_bwd_args, calls) if fwd_bwd else None
        for name in impls:
            t_bwd = None if t_fwd_bwd[name] is None else max(t_fwd_bwd[name] - t_fwd[name], 1e-9)
            samples[name].append((t_fwd[name], t_bwd))
    return samples


def run(args) -> list[dict]:
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    impls = implementations(on_gpu)
    base = "cudnn" if "cudnn" in impls else "xla"
    shapes = grid(on_gpu, args.quick, args.head_dims, args.seqlens)
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
                rows.append({**dataclasses.asdict(shape), "pass": pass_, "impl": name, "seconds": t,
                             "tflops": tflops, f"vs_{base}_rounds": ratios})
        progress(f"d={shape.head_dim} s={shape.seqlen} causal={shape.causal}")
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
        key = (r["head_dim"], r["seqlen"], r["causal"], r["pass"])
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
    parser.add_argument("--decode", action="store_true", help="time decode steps against a KV cache instead")
    parser.add_argument("--ring-seqlen", type=int, default=32768, help="tokens per device for --ring")
    args = parser.parse_args(argv)
    if args.ring:
        from jax_flash import bench_ring

        rows = bench_ring.run(args.ring_seqlen)
        print(f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind}, jax {jax.__version__}, "
              f"{args.ring_seqlen} tokens per device, 16 heads, d = 128, bf16")
        print(bench_ring.table(rows))
        return rows
    if args.decode:
        from jax_flash import bench_decode

        rows = bench_decode.run()
        print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, {bench_decode.HEADS} / "
              f"{bench_decode.KV_HEADS} heads, d = {bench_decode.HEAD_DIM}, cold L2, HBM fraction of 3.35 TB/s")
        print(bench_decode.table(rows))
        if args.plot:
            bench_decode.plot(rows, args.plot)
        return rows
    if args.masks:
        from jax_flash import bench_masks

        rows = []
        for head_dim in args.head_dims or (128,):
            these = bench_masks.run(head_dim)
            print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, d = {head_dim}")
            print(bench_masks.table(these))
            rows += these
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
