"""The benchmark, `python -m jax_flash.bench`: jax_flash against cuDNN, XLA and (when it imports)
FlashAttention-3's JAX binding, on the same inputs in one run.

- timing.py: shapes, peers and the interleaved, rested timing every table shares;
- training.py: the main grid (forward and backward TFLOP/s, ratio to cuDNN), table and plot;
- masks.py (`--masks`), ring.py (`--ring`), decode.py (`--decode`): the other tables;
- cli.py: the command line (`main`).
"""
