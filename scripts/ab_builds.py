"""Two installs of jax_flash timed against each other on the training grid, in interleaved
processes (old, new, new, old), as a kernel change that should not alter speed is checked:
    python scripts/ab_builds.py OLD_DIR NEW_DIR [--head-dims 64 128 256] [--seqlens 2048 ...]
Each DIR holds a `jax_flash` package with its compiled module (a wheel unpacked with
`pip install --no-deps --target DIR`, or a checkout with the module built in place). A worker
imports jax_flash from its DIR alone and uses only the public `jax_flash.attention`, so any two
versions compare. bf16, 16k tokens a batch, hidden 2048; forward, and forward + backward, each
the median of rested loops; backward = step minus forward. A row's time is the best of its
build's processes. Prints a markdown table and new/old's median and range."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ORDER = ("old", "new", "new", "old")  # each build first once, so a drift of clocks favours neither


def worker(path: str, shapes: list[tuple[int, int, bool]], out: str) -> None:
    sys.path.insert(0, os.path.abspath(path))
    import time

    import jax
    import jax.numpy as jnp

    import jax_flash

    assert jax_flash.__file__.startswith(os.path.abspath(path)), jax_flash.__file__

    def median_seconds(fn, args, loops=5):
        jax.block_until_ready(fn(*args))
        once = time.perf_counter()
        jax.block_until_ready(fn(*args))
        calls = max(5, min(200, int(0.025 / max(time.perf_counter() - once, 1e-9)) + 1))
        times = []
        for _ in range(loops):
            time.sleep(0.1)  # rested: the clocks after a neighbour's power draw (bench/timing.py)
            start = time.perf_counter()
            for _ in range(calls):
                result = fn(*args)
            jax.block_until_ready(result)
            times.append((time.perf_counter() - start) / calls)
        return statistics.median(times)

    rows = []
    for d, s, causal in shapes:
        keys = jax.random.split(jax.random.key(s * 7 + d), 4)
        dims = (max(1, 16384 // s), s, max(1, 2048 // d), d)
        q, k, v, do = (jax.random.normal(key, dims, jnp.bfloat16) for key in keys)
        attn = lambda q, k, v: jax_flash.attention(q, k, v, is_causal=causal)  # noqa: E731
        fwd = jax.jit(attn)
        step = jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))
        t_fwd = median_seconds(fwd, (q, k, v))
        t_step = median_seconds(step, (q, k, v, do))
        rows.append({"d": d, "s": s, "causal": causal, "fwd": t_fwd, "step": t_step})
        print(f"  {path}: d={d} s={s} causal={causal} fwd {t_fwd * 1e3:.3f} ms step {t_step * 1e3:.3f} ms",
              file=sys.stderr, flush=True)
    with open(out, "w") as f:
        json.dump(rows, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shapes = [(d, s, c) for d in args.head_dims for s in args.seqlens for c in (False, True)]
    if args.worker:
        return worker(args.old, shapes, args.worker)
    results = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i, build in enumerate(ORDER):
            out = os.path.join(tmp, f"{i}.json")
            path = getattr(args, build)
            env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": os.path.join(tmp, f"cache_{build}"),
                   "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # fmt: skip
            cmd = [sys.executable, __file__, path, path, "--worker", out, "--head-dims", *map(str, args.head_dims),
                   "--seqlens", *map(str, args.seqlens)]  # fmt: skip
            subprocess.run(cmd, env=env, check=True, cwd=tmp)  # cwd: no checkout's jax_flash shadows DIR
            with open(out) as f:
                results[build].append(json.load(f))
    best = {b: [{key: min(r[i][key] for r in runs) if key in ("fwd", "step") else runs[0][i][key]
                 for key in runs[0][i]} for i in range(len(shapes))] for b, runs in results.items()}  # fmt: skip
    print("| d | seqlen | causal | fwd old, ms | fwd new | new / old | bwd old | bwd new | new / old | step new / old |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for old, new in zip(best["old"], best["new"]):
        bwd_old, bwd_new = old["step"] - old["fwd"], new["step"] - new["fwd"]
        r = (new["fwd"] / old["fwd"], bwd_new / bwd_old, new["step"] / old["step"])
        ratios += r[:2]
        print(f"| {old['d']} | {old['s']} | {'yes' if old['causal'] else 'no'} | {old['fwd'] * 1e3:.3f} | "
              f"{new['fwd'] * 1e3:.3f} | {r[0]:.3f} | {bwd_old * 1e3:.3f} | {bwd_new * 1e3:.3f} | {r[1]:.3f} | "
              f"{r[2]:.3f} |")
    print(f"\nnew / old over the {len(ratios)} forward and backward rows: median {statistics.median(ratios):.3f}, "
          f"range {min(ratios):.3f}-{max(ratios):.3f}")


if __name__ == "__main__":
    main()
