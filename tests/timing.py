"""Kernel timings for the GPU tests that bound a cost ratio (packed documents, soft cap).

The H100 runs these kernels at its power cap, so a loop's clocks depend on what ran just before
it; `jax_flash.bench.timing` rests the GPU before each timed loop for that reason, and so does this.
"""

import jax

from jax_flash.bench import timing as bench_timing


def rested_seconds(step, args, calls: int = 10, rounds: int = 3) -> float:
    """Seconds of one call of `step(*args)`: the best of `rounds` of the benchmark's rested loops
    of `calls` calls (compiles and warms up first)."""
    jax.block_until_ready(step(*args))
    return min(bench_timing.rested_loop_seconds(step, args, calls) for _ in range(rounds))
