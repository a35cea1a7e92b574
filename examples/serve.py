"""Continuous batching with the GPT of train_gpt.py: one jitted step serves a changing batch.

    python examples/serve.py                      # trains briefly, then serves 16 requests
    python examples/serve.py --requests 64 --slots 16 --budget 256

Requests with different prompt lengths arrive over time. Each step takes up to `--budget` tokens:
every running sequence decodes one token, and sequences still reading their prompt take chunks of
it (chunked prefill) in what is left. Their keys and values go into one pool of pages, taken from a
free list as sequences grow and returned when they finish; attention is one
`jax_flash.ragged_paged_attention` call a layer over the whole step (prefill chunks and decodes
mixed, no padding), and the step's shapes never change, so it compiles once. It prints tokens/s
against a padded dense batch of the same requests (prompts padded to the longest, every sequence
decoding as long as the longest, in batches of `--slots`), and whether both give the same tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_flash
from jax_flash.flax.rotary import apply_rotary
from train_gpt import CORPUS, GPT, Config, train

PAGE_SIZE = 16
TRASH_PAGE = 0  # padding rows write their keys and values here; no sequence owns it


@dataclasses.dataclass
class Request:
    prompt: np.ndarray  # token ids
    new_tokens: int
    arrival: int  # the step from which it may start
    out: list = dataclasses.field(default_factory=list)
    read: int = 0  # prompt tokens already in the cache
    pages: list = dataclasses.field(default_factory=list)

    @property
    def cached(self) -> int:  # tokens in the cache
        return self.read + max(0, len(self.out) - 1)

    @property
    def done(self) -> bool:
        return len(self.out) >= self.new_tokens


def run_layers(model, tokens, positions, cache, attend):
    """The model's layers over `tokens` at `positions` (rotary); attend(layer, q, k, v, cache) ->
    (out, cache) writes a layer's keys and values into the cache and attends. (x, cache)."""
    x = model.embed(tokens)
    for layer, block in enumerate(model.blocks):
        attn, h = block.attn, block.norm1(x)
        split = lambda y, heads: y.reshape(y.shape[:-1] + (heads, attn.head_dim))  # noqa: E731,B023
        q = apply_rotary(split(attn.query(h), attn.num_heads), positions, attn.rope_base)
        k = apply_rotary(split(attn.key(h), attn.num_kv_heads), positions, attn.rope_base)
        out, cache = attend(layer, q, k, split(attn.value(h), attn.num_kv_heads), cache)
        x = x + attn.out(out.reshape(out.shape[:-2] + (-1,)))
        x = x + block.down(jax.nn.gelu(block.up(block.norm2(x))))
    return x, cache


def make_serve_step(graphdef, cfg: Config, slots: int, budget: int):
    """step(params, pool, tokens [budget], positions [budget], starts [slots + 1], kv_lengths [slots],
    table [slots, max_pages], num_seqs) -> (each sequence's next token [slots], pool), the pool donated."""

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, pool, tokens, positions, starts, kv_lengths, table, num_seqs):
        model = nnx.merge(graphdef, params)
        rows = jnp.arange(budget)
        seq = jnp.minimum(jnp.searchsorted(starts[1:], rows, side="right"), slots - 1)
        real = rows < starts[num_seqs]
        page = jnp.where(real, table[seq, positions // PAGE_SIZE], TRASH_PAGE)
        slot = positions % PAGE_SIZE
        def attend(layer, q, k, v, pool):
            pool = {"k": pool["k"].at[layer, page, slot].set(k), "v": pool["v"].at[layer, page, slot].set(v)}
            out = jax_flash.ragged_paged_attention(q, pool["k"][layer], pool["v"][layer], kv_lengths, table, starts,
                                                   num_seqs)  # fmt: skip
            return out, pool

        x, pool = run_layers(model, tokens, positions, pool, attend)
        last = x[jnp.maximum(starts[1:] - 1, 0)]  # each sequence's last row this step
        logits = model.head(model.norm(last)).astype(jnp.float32)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), pool

    return step


def serve(step, params, cfg: Config, requests: list[Request], slots: int, budget: int, pool_pages: int,
          max_pages: int):  # fmt: skip
    """Runs every request to the end; returns the steps taken."""
    free = list(range(1, pool_pages))  # page 0 is the trash page
    shape = (cfg.layers, pool_pages, PAGE_SIZE, cfg.kv_heads, cfg.width // cfg.heads)
    pool = {"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype)}
    waiting, running, steps = list(requests), [], 0
    while waiting or running:
        while waiting and waiting[0].arrival <= steps and len(running) < slots:
            running.append(waiting.pop(0))
        tokens, positions, starts, lengths = [], [], [0], []
        table = np.zeros((slots, max_pages), np.int32)
        left = budget - sum(1 for r in running if r.read == len(r.prompt))  # a decode token each
        batch = []
        for r in running:
            if r.read < len(r.prompt):  # a chunk of its prompt, in the budget left
                take = min(len(r.prompt) - r.read, max(0, left))
                if take == 0:
                    continue
                left -= take
                chunk, first = r.prompt[r.read: r.read + take], r.read
            else:  # its last token
                chunk, first = np.asarray(r.out[-1:]), r.cached
            while len(r.pages) * PAGE_SIZE < first + len(chunk):
                r.pages.append(free.pop())
            tokens += list(chunk)
            positions += list(range(first, first + len(chunk)))
            starts.append(starts[-1] + len(chunk))
            lengths.append(first + len(chunk))
            table[len(batch), : len(r.pages)] = r.pages
            batch.append((r, len(chunk)))
        pad = budget - len(tokens)
        starts += [starts[-1]] * (slots + 1 - len(starts))
        lengths += [0] * (slots - len(lengths))
        next_tokens, pool = step(params, pool, jnp.asarray(tokens + [0] * pad, jnp.int32),
                                 jnp.asarray(positions + [0] * pad, jnp.int32), jnp.asarray(starts, jnp.int32),
                                 jnp.asarray(lengths, jnp.int32), jnp.asarray(table), jnp.int32(len(batch)))  # fmt: skip
        next_tokens = np.asarray(next_tokens)
        for i, (r, taken) in enumerate(batch):
            if r.read < len(r.prompt):
                r.read += taken
                if r.read < len(r.prompt):
                    continue  # more prompt to read: no token yet
            r.out.append(int(next_tokens[i]))
        for r in [r for r in running if r.done]:
            free += r.pages
            r.pages = []
            running.remove(r)
        steps += 1
    return steps


def padded_batches(graphdef, params, cfg: Config, requests: list[Request], slots: int) -> list[list[int]]:
    """The same requests in dense batches of `slots` (arrivals ignored: each batch starts when
    it is full): prompts padded on the right to the longest, each row's own length as its
    query and key lengths, then every row decoding as long as the longest, with jax_flash.attention
    over a dense cache."""
    # One shape for every batch (the longest prompt and generation of all), so that it compiles once.
    longest, new = max(len(r.prompt) for r in requests), max(r.new_tokens for r in requests)
    outs = []
    for i in range(0, len(requests), slots):
        group = requests[i: i + slots]
        group = group + [group[-1]] * (slots - len(group))  # a full batch (the repeats are dropped)
        outs += [list(t) for t in _dense_generate(graphdef, params, cfg, group, longest, new)]
    return outs[: len(requests)]


def _dense_generate(graphdef, params, cfg, group, longest, new):
    """Greedy generation of one padded batch: a prefill step of the padded prompts, then one token
    a step; each row's own prompt length gives its key lengths and positions."""
    b = len(group)
    cache_len = longest + new
    shape = (cfg.layers, b, cache_len, cfg.kv_heads, cfg.width // cfg.heads)
    cache = {"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype)}
    prompts = np.zeros((b, longest), np.int32)
    for j, r in enumerate(group):
        prompts[j, : len(r.prompt)] = r.prompt
    lengths0 = jnp.asarray([len(r.prompt) for r in group], jnp.int32)
    step = _dense_step(graphdef, b, cache_len)
    token, cache = step(params, cache, jnp.asarray(prompts), jnp.zeros((b,), jnp.int32), lengths0)
    out = [token]
    for t in range(new - 1):
        token, cache = step(params, cache, token, lengths0 + t, lengths0 + t + 1)
        out.append(token)
    tokens = np.concatenate([np.asarray(o) for o in out], axis=1)
    return [tokens[j, : r.new_tokens] for j, r in enumerate(group)]


@functools.lru_cache(maxsize=None)
def _dense_step(graphdef, b, cache_len):
    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, cache, tokens, first, lengths):
        """tokens [B, T] at positions first[b] + t; lengths: the cache's tokens after them. The
        next token follows each row's last real token (position lengths - 1)."""
        model = nnx.merge(graphdef, params)
        t = tokens.shape[1]
        positions = first[:, None] + jnp.arange(t)
        rows = jnp.arange(b)[:, None]

        def attend(layer, q, k, v, cache):
            cache = {"k": cache["k"].at[layer, rows, positions].set(k), "v": cache["v"].at[layer, rows, positions].set(v)}
            # Each row's queries at first + t, its keys up to `lengths`: T == S is not the case, so
            # the diagonal follows the lengths (query i at key position i + kv_len - q_len).
            q_len = jnp.minimum(lengths - first, t)
            out = jax_flash.attention(q, cache["k"][layer], cache["v"][layer], is_causal=True,
                                      query_seq_lengths=q_len, key_value_seq_lengths=lengths)  # fmt: skip
            return out, cache

        x, cache = run_layers(model, tokens, positions, cache, attend)
        last = x[jnp.arange(b), jnp.maximum(lengths - first - 1, 0)]
        logits = model.head(model.norm(last)).astype(jnp.float32)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None], cache

    return step


def main(argv=None):
    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--slots", type=int, default=8, help="sequences a step at most")
    parser.add_argument("--budget", type=int, default=64, help="tokens a step at most")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--train-steps", type=int, default=200 if on_gpu else 40)
    args = parser.parse_args(argv)
    chars = sorted(set(CORPUS))
    cfg = Config(vocab=len(chars), seq=128, width=256 if on_gpu else 64, heads=8 if on_gpu else 4,
                 kv_heads=4 if on_gpu else 2, layers=2, dtype=jnp.bfloat16 if on_gpu else jnp.float32)  # fmt: skip
    graphdef, _ = nnx.split(GPT(cfg, jax_flash.attention, nnx.Rngs(0)))
    _, _, params = train(cfg, jax_flash.attention, args.train_steps, 16, log_every=10**9, quiet=True)
    rng = np.random.default_rng(0)
    text = np.asarray([chars.index(c) for c in CORPUS], np.int32)

    def requests():
        out = []
        for i in range(args.requests):
            length = int(rng.integers(4, 100))
            start = int(rng.integers(0, len(text) - length))
            out.append(Request(text[start: start + length], args.new_tokens, arrival=i // 2))
        return out

    max_pages = -(-(100 + args.new_tokens) // PAGE_SIZE)
    pool_pages = 1 + args.slots * max_pages
    step = make_serve_step(graphdef, cfg, args.slots, args.budget)
    warm_up = requests()
    serve(step, params, cfg, warm_up, args.slots, args.budget, pool_pages, max_pages)  # compiles the step
    served = [Request(r.prompt, r.new_tokens, r.arrival) for r in warm_up]
    start = time.perf_counter()
    steps = serve(step, params, cfg, served, args.slots, args.budget, pool_pages, max_pages)
    seconds = time.perf_counter() - start
    generated = sum(r.new_tokens for r in served)
    padded_batches(graphdef, params, cfg, warm_up, args.slots)  # compiles the padded steps
    start = time.perf_counter()
    dense = padded_batches(graphdef, params, cfg, served, args.slots)
    dense_seconds = time.perf_counter() - start
    same = sum(r.out == d for r, d in zip(served, dense))
    print(f"device: {jax.devices()[0].device_kind}; {args.requests} requests, {args.slots} slots, {args.budget} "
          f"tokens a step, {generated} tokens generated")
    print(f"continuous batching: {steps} steps, {generated / seconds:,.0f} tokens/s")
    print(f"padded dense batches: {generated / dense_seconds:,.0f} tokens/s")
    print(f"continuous / padded tokens/s: {dense_seconds / seconds:.2f}; same tokens in {same} of {len(served)} "
          "requests")
    return served, dense


if __name__ == "__main__":
    main()
