"""jax_flash.attention under jit on whatever device JAX sees: agreement with jax.nn and the time.

    python examples/quickstart.py
"""

import time

import jax
import jax.numpy as jnp

import jax_flash


def timed(fn, *args, repeats=5):
    fn(*args).block_until_ready()  # compile and warm up
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    out.block_until_ready()
    return out, (time.perf_counter() - start) / repeats


def main():
    on_gpu = jax.default_backend() == "gpu"
    batch, seq, heads, kv_heads, head_dim = (4, 4096, 16, 4, 128) if on_gpu else (2, 512, 4, 2, 64)
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (batch, seq, heads, head_dim), dtype)
    k = jax.random.normal(kk, (batch, seq, kv_heads, head_dim), dtype)
    v = jax.random.normal(kv, (batch, seq, kv_heads, head_dim), dtype)

    ours = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True))
    theirs = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
    out, t_ours = timed(ours, q, k, v)
    ref, t_theirs = timed(theirs, q, k, v)
    err = jnp.linalg.norm((out - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32))

    print(f"device: {jax.devices()[0].device_kind}  shape q={q.shape} k={k.shape} {jnp.dtype(dtype).name}")
    print(f"relative difference to jax.nn.dot_product_attention: {float(err):.2e}")
    print(f"jax_flash.attention: {t_ours * 1e3:8.2f} ms   jax.nn.dot_product_attention: {t_theirs * 1e3:8.2f} ms")
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    if not err < tolerance:
        raise SystemExit(f"FAILED: difference {float(err):.2e} above {tolerance}")


if __name__ == "__main__":
    main()
