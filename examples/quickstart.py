"""jax_flash.attention under jit on whatever device JAX sees, against jax.nn.dot_product_attention
on the same inputs: the difference between the two, which path each took, and their times.

    python examples/quickstart.py

On a GPU the comparison is with cuDNN's fused attention (jax.nn's fastest), on a CPU with jax.nn's
XLA attention. Each time is the median of interleaved rounds, so that neither gets a warmer start.
"""

import statistics
import time

import jax
import jax.numpy as jnp

import jax_flash


def seconds_per_call(fn, args, calls: int = 5) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls


def main():
    on_gpu = jax.default_backend() == "gpu"
    batch, seq, heads, kv_heads, head_dim = (4, 4096, 16, 4, 128) if on_gpu else (2, 512, 4, 2, 64)
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (batch, seq, heads, head_dim), dtype)
    k = jax.random.normal(kk, (batch, seq, kv_heads, head_dim), dtype)
    v = jax.random.normal(kv, (batch, seq, kv_heads, head_dim), dtype)

    theirs_impl = "cudnn" if on_gpu else "xla"
    ours = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True))
    theirs = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                 implementation=theirs_impl))  # fmt: skip
    out, ref = ours(q, k, v), theirs(q, k, v)  # compile and warm up
    # Rounds alternate which goes first, and the ratio is the median of each round's: on a 2-core
    # CPU single loops of the same program moved by 30% (2026-12-01), far more than the two differ.
    rounds = []
    for i in range(15):
        pair = [(ours, 0), (theirs, 1)][:: 1 if i % 2 else -1]
        times = dict((which, seconds_per_call(fn, (q, k, v))) for fn, which in pair)
        rounds.append((times[0], times[1]))
    t_ours, t_theirs = (statistics.median(r[i] for r in rounds) for i in (0, 1))
    ratio = statistics.median(theirs_s / ours_s for ours_s, theirs_s in rounds)
    err = jnp.linalg.norm((out - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32))

    path = jax_flash.chosen_implementation(q, k, v, is_causal=True)
    print(f"device: {jax.devices()[0].device_kind}  shape q={q.shape} k={k.shape} {jnp.dtype(dtype).name}, causal")
    print(f"relative difference to jax.nn.dot_product_attention: {float(err):.2e}")
    print(f"jax_flash.attention ({path} path): {t_ours * 1e3:8.2f} ms")
    print(f"jax.nn.dot_product_attention ({theirs_impl}): {t_theirs * 1e3:8.2f} ms   ratio {ratio:.2f}x")
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    if not err < tolerance:
        raise SystemExit(f"FAILED: difference {float(err):.2e} above {tolerance}")


if __name__ == "__main__":
    main()
