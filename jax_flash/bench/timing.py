"""What every table of the benchmark shares: its shapes and FLOP counts, the peers it times us
against, and how it times (interleaved rounds of rested loops)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import jax

@dataclasses.dataclass(frozen=True)
class Shape:
    head_dim: int
    seqlen: int
    causal: bool
    batch: int
    heads: int
    value_head_dim: int | None = None  # None: head_dim
    kv_heads: int | None = None  # None: heads

    @property
    def dv(self) -> int:
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

    @property
    def label(self) -> str:
        """The head dim as the tables print it: "128", or "192/128" with another value head dim."""
        return str(self.head_dim) if self.dv == self.head_dim else f"{self.head_dim}/{self.dv}"

    def flops(self, backward: bool) -> float:
        """Matmul FLOPs: forward Q K^T (head_dim) and P V (dv); backward S again, dQ and dK
        (head_dim), dP and dV (dv). With equal dims 4 b h s^2 d forward, 2.5x that backward."""
        per_dim = 2.0 * self.batch * self.heads * self.seqlen**2 / (2 if self.causal else 1)
        d, dv = self.head_dim, self.dv
        return per_dim * (3 * d + 2 * dv) if backward else per_dim * (d + dv)


def peers(on_gpu: bool) -> dict[str, Callable]:
    """name -> attention(q, k, v, is_causal, local_window_size=None) of each peer that runs here:
    on a GPU cuDNN and, when they import, FlashAttention-3's JAX binding and tokamax."""
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
    found.update(tokamax_peers())
    return found


TOKAMAX_IMPLEMENTATIONS = ("mosaic", "triton")


def tokamax_peers() -> dict[str, Callable]:
    """tokamax's dot_product_attention (Google's Pallas kernels; jax.nn's signature), one column per
    implementation, when it imports: an optional peer, never a dependency."""
    try:
        import tokamax
    except ImportError:
        return {}

    def peer(implementation: str) -> Callable:
        return lambda q, k, v, is_causal, local_window_size=None: tokamax.dot_product_attention(
            q, k, v, is_causal=is_causal, local_window_size=local_window_size, implementation=implementation)

    return {f"tokamax_{name}": peer(name) for name in TOKAMAX_IMPLEMENTATIONS}


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
    kv_dims = dims[:2] + (shape.kv_heads or shape.heads, shape.head_dim)
    value_dims, out_dims = kv_dims[:3] + (shape.dv,), dims[:3] + (shape.dv,)
    q, k, v, do = (jax.random.normal(key, d, dtype) for key, d in zip(keys, (dims, kv_dims, value_dims, out_dims)))
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
