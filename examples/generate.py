"""Greedy generation from a KV cache with the GPT of train_gpt.py: a dense cache and a paged one.

    python examples/generate.py                          # trains briefly, then generates
    python examples/generate.py --batch 8 --cache 16384 --prompt-length 16000  # on a GPU: a long context
    python examples/generate.py --kv-dtype fp8            # also fp8 caches (float8_e4m3fn), beside the others

A step takes T tokens of every sequence: their keys and values are written into the cache (its
buffers donated, so updated in place), then their queries attend to the cache. The prompt is one
step (a chunked prefill: T = its length, at position 0); the new tokens come from one jitted call
that loops the T = 1 step on the device, so that tokens/s measures the model rather than the
host's dispatch of a call per token. Prints the text, tokens/s with jax_flash (dense and paged
cache) and with jax.nn's attention (cuDNN on a GPU, XLA on a CPU) in the same run, their ratio,
and the share of a step that attention takes (against the same step with attention left out).
With `--kv-dtype fp8` the jax_flash caches also run in float8_e4m3fn: each layer's keys and values
quantized as they are written, with one scale per kv head set at the first write (the prompt's
absolute maximum, with headroom) and kept; it prints how far the logits move against the model's
dtype (the prompt's, and the last step's where the tokens agree).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_flash
from jax_flash.flax.rotary import apply_rotary
from train_gpt import CORPUS, GPT, Config, train

PAGE_SIZE = 64
FP8 = jnp.float8_e4m3fn
# A cache's scales come from its first write (the prompt): later tokens may reach further, so the
# scales leave this much room above the prompt's largest value before values are clipped.
FP8_HEADROOM = 2.0


def dense_cache(cfg: Config, batch: int, length: int):
    shape = (cfg.layers, batch, length, cfg.kv_heads, cfg.width // cfg.heads)
    return {"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype)}


def paged_cache(cfg: Config, batch: int, length: int, seed: int = 0):
    """A pool of pages with each sequence's pages at shuffled places, and the page table."""
    pages = -(-length // PAGE_SIZE)
    shape = (cfg.layers, batch * pages + 1, PAGE_SIZE, cfg.kv_heads, cfg.width // cfg.heads)
    table = np.random.default_rng(seed).permutation(batch * pages).reshape(batch, pages)
    return {"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype), "table": jnp.asarray(table, jnp.int32)}


def write_dense(cache, layer, k, v, position):
    """k, v: [B, T, K, H] at positions [position, position + T) (the same for every sequence here).
    One update of the whole [layers, ...] buffer, which XLA does in place (a slice of the layer,
    updated and put back, copied the layer's cache every step)."""
    at = tuple(jnp.asarray(i, jnp.int32) for i in (layer, 0, position, 0, 0))  # one index type (also under x64)
    put = lambda c, x: jax.lax.dynamic_update_slice(c, x[None], at)  # noqa: E731
    return {**cache, "k": put(cache["k"], k), "v": put(cache["v"], v)}


def write_paged(cache, layer, k, v, position):
    positions = position + jnp.arange(k.shape[1])
    page, slot = cache["table"][:, positions // PAGE_SIZE], positions % PAGE_SIZE  # [B, T], [T]
    return {**cache, "k": cache["k"].at[layer, page, slot].set(k),
            "v": cache["v"].at[layer, page, slot].set(v)}  # fmt: skip


def fp8_cache(make):
    """The cache of `make` in fp8, with [layers, K] scales for keys and values (0: not yet set)."""

    def make_fp8(cfg: Config, batch: int, length: int):
        cache = make(cfg, batch, length)
        scales = lambda: jnp.zeros((cfg.layers, cfg.kv_heads), jnp.float32)  # noqa: E731 (two buffers, both donated)
        return {**cache, "k": cache["k"].astype(FP8), "v": cache["v"].astype(FP8), "k_scale": scales(),
                "v_scale": scales()}  # fmt: skip

    return make_fp8


def fp8_write(write):
    """`write` of k and v quantized with the layer's scales, which the first write sets."""

    def write_fp8(cache, layer, k, v, position):
        quantized = {}
        for name, x in (("k", k), ("v", v)):
            scale = cache[f"{name}_scale"][layer]
            first = jax_flash.quantize_kv(x)[1] * FP8_HEADROOM
            scale = jnp.where(scale > 0, scale, first)
            largest = float(jnp.finfo(FP8).max)
            quantized[name] = jnp.clip(x.astype(jnp.float32) / scale[:, None], -largest, largest).astype(FP8)
            cache = {**cache, f"{name}_scale": cache[f"{name}_scale"].at[layer].set(scale)}
        return write(cache, layer, quantized["k"], quantized["v"], position)

    return write_fp8


def _scales(c, layer):
    return {"key_scale": c["k_scale"][layer], "value_scale": c["v_scale"][layer]}


FP8_ATTENTION = {
    "jax_flash fp8": (fp8_cache(dense_cache), fp8_write(write_dense), lambda q, c, layer, lengths: jax_flash.attention(
        q, c["k"][layer], c["v"][layer], is_causal=True, key_value_seq_lengths=lengths, **_scales(c, layer))),
    "jax_flash paged fp8": (fp8_cache(paged_cache), fp8_write(write_paged), lambda q, c, layer, lengths:
                            jax_flash.paged_attention(q, c["k"][layer], c["v"][layer], lengths, c["table"],
                                                      is_causal=True, **_scales(c, layer))),
}  # fmt: skip


ATTENTION = {  # name -> (make cache, write, attend(q, cache, layer, lengths))
    "jax_flash": (dense_cache, write_dense, lambda q, c, layer, lengths: jax_flash.attention(
        q, c["k"][layer], c["v"][layer], is_causal=True, key_value_seq_lengths=lengths)),
    "jax_flash paged": (paged_cache, write_paged, lambda q, c, layer, lengths: jax_flash.paged_attention(
        q, c["k"][layer], c["v"][layer], lengths, c["table"], is_causal=True)),
    # jax.nn's causal mask is aligned top-left: right for the prompt (T > 1 only at position 0); a
    # T = 1 step sees every key up to its length.
    "jax.nn": (dense_cache, write_dense, lambda q, c, layer, lengths: jax.nn.dot_product_attention(
        q, c["k"][layer], c["v"][layer], key_value_seq_lengths=lengths, is_causal=q.shape[1] > 1,
        implementation="cudnn" if jax.default_backend() == "gpu" else "xla")),
    "no attention": (dense_cache, write_dense, lambda q, c, layer, lengths: jnp.zeros_like(q)),
}  # fmt: skip


def make_step(graphdef, name: str):
    """step(params, cache, tokens [B, T], position) -> (next tokens [B, 1], cache, logits [B, 1, V]):
    T tokens of every sequence (at positions [position, position + T)) through the model, their
    keys and values written into the cache first; the next token follows the last."""
    _, write, attend = {**ATTENTION, **FP8_ATTENTION}[name]

    def step(params, cache, tokens, position):
        model = nnx.merge(graphdef, params)
        x = model.embed(tokens)
        positions = position + jnp.arange(tokens.shape[1])
        lengths = jnp.full((tokens.shape[0],), position + tokens.shape[1], jnp.int32)
        for layer, block in enumerate(model.blocks):
            attn, h = block.attn, block.norm1(x)
            split = lambda y, heads: y.reshape(y.shape[:-1] + (heads, attn.head_dim))  # noqa: E731,B023
            q = apply_rotary(split(attn.query(h), attn.num_heads), positions, attn.rope_base)
            k = apply_rotary(split(attn.key(h), attn.num_kv_heads), positions, attn.rope_base)
            cache = write(cache, layer, k, split(attn.value(h), attn.num_kv_heads), position)
            out = attend(q, cache, layer, lengths)
            x = x + attn.out(out.reshape(out.shape[:-2] + (-1,)))
            x = x + block.down(jax.nn.gelu(block.up(block.norm2(x))))
        logits = model.head(model.norm(x[:, -1:])).astype(jnp.float32)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache, logits

    return step


def make_generators(graphdef, name: str, vocab: int):
    """(prefill, decode), each jitted with the cache donated (updated in place):
    prefill(params, cache, prompt [B, P], 0) feeds the prompt in one step; decode(params, cache,
    tokens, position, n) generates n tokens greedily in one call (a loop of steps on the device, so that
    the host's dispatch of each step does not set the pace). Both return the last step's logits."""
    step = make_step(graphdef, name)
    prefill = jax.jit(step, donate_argnums=(1,))

    @functools.partial(jax.jit, donate_argnums=(1,), static_argnums=(4,))
    def decode(params, cache, tokens, position, n):
        def body(i, carry):
            cache, tokens, out, _ = carry
            tokens, cache, logits = step(params, cache, tokens, position + i)
            return cache, tokens, out.at[:, i].set(tokens[:, 0]), logits

        out = jnp.zeros((tokens.shape[0], n), jnp.int32)
        logits = jnp.zeros((tokens.shape[0], 1, vocab), jnp.float32)
        cache, _, out, logits = jax.lax.fori_loop(0, n, body, (cache, tokens, out, logits))
        return out, cache, logits

    return prefill, decode


def generate(generators, params, cfg: Config, name: str, prompt: np.ndarray, new_tokens: int, cache_length: int):
    """Greedy continuation of `prompt` [B, P]: (tokens [B, P + 1 + 2 (new_tokens // 2)], seconds per
    new token, the prompt's logits, the last step's logits). The prompt is one prefill step, which
    gives the first new token; the others come from two decode calls of new_tokens // 2 each (the
    first compiles on a fresh run); the second is timed."""
    prefill, decode = generators
    batch, prompt_length = prompt.shape
    cache = {**ATTENTION, **FP8_ATTENTION}[name][0](cfg, batch, cache_length)
    token, cache, prompt_logits = prefill(params, cache, jnp.asarray(prompt), jnp.int32(0))
    half = max(1, new_tokens // 2)
    first, cache, _ = decode(params, cache, token, jnp.int32(prompt_length), half)
    last = jax.block_until_ready(first[:, -1:])  # sliced before the clock: a slice compiles on first use
    start = time.perf_counter()
    second, cache, last_logits = decode(params, cache, last, jnp.int32(prompt_length + half), half)
    jax.block_until_ready(second)
    seconds = (time.perf_counter() - start) / half
    tokens = np.concatenate([prompt, np.asarray(token), np.asarray(first), np.asarray(second)], axis=1)
    return tokens, seconds, np.asarray(prompt_logits), np.asarray(last_logits)


def logits_moved(logits: np.ndarray, reference: np.ndarray) -> str:
    """How far `logits` lie from `reference`: the largest difference, and the norm of the
    difference over the reference's."""
    diff = np.abs(logits - reference)
    return f"max |d| {diff.max():.3g}, relative {np.linalg.norm(diff) / np.linalg.norm(reference):.2e}"


def main(argv=None):
    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--cache", type=int, default=4096 if on_gpu else 256, help="cache buffer length")
    parser.add_argument("--prompt-length", type=int, default=0,
                        help="tokens of context before generating: the training text cut to this length (the model "
                             "was trained on 128, so past that the text is noise, but the timing is a long context's); "
                             "0: a short prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--train-steps", type=int, default=200 if on_gpu else 60)
    parser.add_argument("--rounds", type=int, default=5 if on_gpu else 1, help="generations of each implementation")
    parser.add_argument("--kv-dtype", choices=("model", "fp8"), default="model",
                        help="fp8: also the jax_flash caches in float8_e4m3fn (scales per layer and kv head)")
    args = parser.parse_args(argv)
    chars = sorted(set(CORPUS))
    cfg = Config(vocab=len(chars), seq=128, width=512 if on_gpu else 128, heads=8 if on_gpu else 4,
                 kv_heads=4 if on_gpu else 2, layers=4 if on_gpu else 2,
                 dtype=jnp.bfloat16 if on_gpu else jnp.float32)  # fmt: skip
    print(f"device: {jax.devices()[0].device_kind}; batch {args.batch}, cache {args.cache}, prompt "
          f"{args.prompt_length or 'short'}; training "
          f"{args.train_steps} steps first")
    graphdef, _ = nnx.split(GPT(cfg, jax_flash.attention, nnx.Rngs(0)))
    _, _, params = train(cfg, jax_flash.attention, args.train_steps, 16, log_every=10**9, quiet=True)
    prompt_text = np.resize(list(CORPUS), args.prompt_length) if args.prompt_length else "Attention lets every position"
    if len(prompt_text) >= args.cache:
        parser.error(f"--prompt-length must be below --cache ({args.cache}), got {len(prompt_text)}")
    prompt = np.tile(np.asarray([[chars.index(c) for c in prompt_text]], np.int32), (args.batch, 1))
    new_tokens = min(args.new_tokens, args.cache - prompt.shape[1])
    # Interleaved rounds, each implementation first in turn; the median time a token of each.
    names = list(ATTENTION) + (list(FP8_ATTENTION) if args.kv_dtype == "fp8" else [])
    generators = {name: make_generators(graphdef, name, cfg.vocab) for name in names}
    runs = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:
            runs[name].append(generate(generators[name], params, cfg, name, prompt, new_tokens, args.cache))
    results = {name: (done[0][0], statistics.median(run[1] for run in done), *done[0][2:]) for name, done in runs.items()}
    shown = results["jax_flash"][0][0][max(0, prompt.shape[1] - 40):]  # the prompt's last 40 tokens, then the new
    print(f"generated: {''.join(chars[i] for i in shown)!r}")
    for name, (tokens, seconds, *_) in results.items():
        same = "same tokens" if np.array_equal(tokens, results["jax_flash"][0]) else "other tokens"
        print(f"{name:20s} {seconds * 1e3:7.3f} ms/step  {args.batch / seconds:10,.0f} tokens/s  ({same})")
    ours, theirs, none = (results[n][1] for n in ("jax_flash", "jax.nn", "no attention"))
    print(f"jax_flash / jax.nn tokens/s: {theirs / ours:.2f}; attention's share of a jax_flash step: "
          f"{max(0.0, 1 - none / ours):.0%}")
    for name in FP8_ATTENTION if args.kv_dtype == "fp8" else ():
        base = name.replace(" fp8", "")
        tokens, seconds, prompt_logits, last_logits = results[name]
        moved = f"prompt's logits: {logits_moved(prompt_logits, results[base][2])}"
        if np.array_equal(tokens, results[base][0]):
            moved += f"; last step's: {logits_moved(last_logits, results[base][3])}"
        print(f"{name} / {base} tokens/s: {results[base][1] / seconds:.2f}; {moved}")
    return results


if __name__ == "__main__":
    main()
