"""Kernel timings for the GPU tests that bound a cost ratio (packed documents, soft cap).

The H100 runs these kernels at its power cap, so a loop's clocks depend on what ran just before
it; `jax_flash.bench` rests the GPU before each timed loop for that reason, and so does this.
"""

import time

import jax

from jax_flash import bench


def rested_seconds(step, args, calls: int = 10, rounds: int = 3) -> float:
    """Seconds of one call of `step(*args)`: the best of `rounds` loops of `calls` calls (the
    benchmark's loop), each after `bench.REST_SECONDS` idle (compiles and warms up first)."""
    jax.block_until_ready(step(*args))
    best = float("inf")
    for _ in range(rounds):
        time.sleep(bench.REST_SECONDS)
        best = min(best, bench._loop_seconds(step, args, calls))
    return best
