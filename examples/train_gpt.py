"""A small character-level GPT (Flax nnx + optax) trained with jax_flash attention.

    python examples/train_gpt.py              # a few hundred steps; CPU or GPU
    python examples/train_gpt.py --steps 1000

Prints the loss as it falls and the throughput; on a GPU it also times the same model with
jax.nn.dot_product_attention (cuDNN) and prints the step-time ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_flash
from jax_flash.flax.nnx import MultiHeadAttention

CORPUS = """\
Attention lets every position of a sequence look at every other position and take a weighted
average of what it finds there. The weights come from a softmax over the dot products of a query
with all the keys, and the average is taken over the values. Computed naively, the matrix of
weights has as many entries as the square of the sequence length, and it has to be written to
memory and read back. FlashAttention never writes it: it walks over blocks of keys, keeps a
running maximum and a running sum for every query row, and rescales the partial output whenever
the maximum grows. The result is exact, the memory is linear in the sequence length, and the
arithmetic stays on the chip where it is fast. The backward pass recomputes each block of weights
from the saved log-sum-exp instead of storing them, trading a little arithmetic for a great deal
of memory traffic. A causal model only lets a token see the tokens before it, so half of the
blocks can be skipped entirely. Grouped queries share one key and value head among several query
heads, which shrinks the cache that a model keeps while it generates text one token at a time.
Small models learn the spelling of common words first, then short phrases, then the rhythm of
whole sentences, and the loss falls quickly at the start and slowly after that.
"""


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int
    seq: int
    width: int
    heads: int
    kv_heads: int
    layers: int
    dtype: jnp.dtype


class Block(nnx.Module):
    def __init__(self, cfg: Config, attention, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(cfg.width, dtype=cfg.dtype, rngs=rngs)
        self.attn = MultiHeadAttention(cfg.width, cfg.heads, num_kv_heads=cfg.kv_heads, is_causal=True,
                                       dtype=cfg.dtype, attention=attention, rngs=rngs)  # fmt: skip
        self.norm2 = nnx.LayerNorm(cfg.width, dtype=cfg.dtype, rngs=rngs)
        self.up = nnx.Linear(cfg.width, 4 * cfg.width, dtype=cfg.dtype, rngs=rngs)
        self.down = nnx.Linear(4 * cfg.width, cfg.width, dtype=cfg.dtype, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class GPT(nnx.Module):
    def __init__(self, cfg: Config, attention, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.width, dtype=cfg.dtype, rngs=rngs)
        blocks = [Block(cfg, attention, rngs) for _ in range(cfg.layers)]
        self.blocks = nnx.List(blocks) if hasattr(nnx, "List") else blocks  # nnx.List: flax >= 0.12
        self.norm = nnx.LayerNorm(cfg.width, dtype=cfg.dtype, rngs=rngs)
        self.head = nnx.Linear(cfg.width, cfg.vocab, dtype=cfg.dtype, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).astype(jnp.float32)


def corpus_on_device(seq: int) -> jax.Array:
    """The corpus as int32 character ids on the device, tiled to hold windows of seq + 1."""
    chars = sorted(set(CORPUS))
    data = np.array([chars.index(c) for c in CORPUS], np.int32)
    return jnp.asarray(np.tile(data, -(-(seq + 1) * 2 // len(data))))


def make_train_step(graphdef, optimizer, data: jax.Array, seq: int, batch: int):
    """One jitted step that draws its own batch of random windows of `data` from `key`: nothing
    goes from the host to the device per step, so the step time is the model's, not Python's."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, key):
        starts = jax.random.randint(key, (batch,), 0, data.shape[0] - seq - 1)
        window = data[starts[:, None] + jnp.arange(seq + 1)]
        inputs, targets = window[:, :-1], window[:, 1:]

        def loss_fn(params):
            logits = nnx.merge(graphdef, params)(inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def train(cfg: Config, attention, steps: int, batch: int, log_every: int, quiet: bool = False):
    """Returns (losses, seconds per step after the first (compiling) one, the trained parameters)."""
    graphdef, params = nnx.split(GPT(cfg, attention, nnx.Rngs(0)))
    optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, max(steps, 21)))
    opt_state = optimizer.init(params)
    step = make_train_step(graphdef, optimizer, corpus_on_device(cfg.seq), cfg.seq, batch)
    keys = jax.random.split(jax.random.key(0), steps)
    losses, start = [], None
    for i in range(steps):
        params, opt_state, loss = step(params, opt_state, keys[i])
        losses.append(loss)
        if i == 0:
            jax.block_until_ready(loss)  # compiled: the clock starts
            start = time.perf_counter()
        if not quiet and (i % log_every == 0 or i == steps - 1):
            print(f"step {i:5d}  loss {float(loss):.3f}", flush=True)
    jax.block_until_ready(losses[-1])
    per_step = (time.perf_counter() - start) / max(steps - 1, 1)
    return [float(x) for x in losses], per_step, params


def main(argv=None):
    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024 if on_gpu else 128)
    parser.add_argument("--no-compare", action="store_true", help="skip the jax.nn comparison on GPU")
    args = parser.parse_args(argv)
    chars = sorted(set(CORPUS))
    cfg = Config(vocab=len(chars), seq=args.seq, width=512 if on_gpu else 128,
                 heads=8 if on_gpu else 4, kv_heads=4 if on_gpu else 2, layers=4 if on_gpu else 2,
                 dtype=jnp.bfloat16 if on_gpu else jnp.float32)  # fmt: skip
    print(f"device: {jax.devices()[0].device_kind}; {cfg}")
    losses, per_step, _ = train(cfg, jax_flash.attention, args.steps, args.batch, log_every=50)
    tokens_per_s = args.batch * cfg.seq / per_step
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; {per_step * 1e3:.1f} ms/step, "
          f"{tokens_per_s:,.0f} tokens/s with jax_flash")
    if on_gpu and not args.no_compare:
        cudnn = functools.partial(jax.nn.dot_product_attention, implementation="cudnn")
        _, cudnn_step, _ = train(cfg, cudnn, min(args.steps, 50), args.batch, 50, quiet=True)
        print(f"jax.nn cuDNN attention: {cudnn_step * 1e3:.1f} ms/step; "
              f"step-time ratio jax_flash / cuDNN = {per_step / cudnn_step:.2f}")
    return losses


if __name__ == "__main__":
    main()
