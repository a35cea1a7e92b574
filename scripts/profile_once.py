"""Runs jax_flash forward and backward once on one benchmark shape (or, with --decode, one decode
step; with --ragged, one ragged step), for a profiler or compute-sanitizer to attach to:

    ncu --clock-control none -k regex:bwd_kernel python scripts/profile_once.py --head-dim 128 --seqlen 4096

Random bf16 inputs, 16k tokens, hidden 2048, as in python -m jax_flash.bench.
"""

import argparse

import jax
import jax.numpy as jnp

import jax_flash

parser = argparse.ArgumentParser()
parser.add_argument("--head-dim", type=int, default=128)
parser.add_argument("--seqlen", type=int, default=4096)
parser.add_argument("--causal", action="store_true")
parser.add_argument("--tokens", type=int, default=16384, help="batch x seqlen (rounded up)")
parser.add_argument("--masks", action="store_true",
                    help="sequence lengths and four packed documents a row (the masked kernels)")
parser.add_argument("--lengths", action="store_true",
                    help="sequence lengths alone (the masked kernels without segment ids)")
parser.add_argument("--softcap", type=float, default=None, help="logit soft cap (the softcap kernels)")
parser.add_argument("--window", type=int, default=None, help="local window: this many keys to the left")
parser.add_argument("--bias", action="store_true",
                    help="a [1, N, T, S] bias, differentiated (the bias kernels); with --masks also a [B, 1, T, S] "
                    "boolean mask")
parser.add_argument("--decode", type=int, nargs=2, metavar=("BATCH", "CACHE"), default=None,
                    help="instead: one decode step, T = --queries queries of 32 heads over 8 kv heads against a "
                    "cache of CACHE tokens (the decode kernels)")
parser.add_argument("--ragged", action="store_true",
                    help="instead: one ragged step (a 300-token prefill chunk over 1,000 tokens beside 4 decodes, "
                    "32 heads over 8 kv heads) over pages of --page-size (16) tokens: the ragged kernels")
parser.add_argument("--queries", type=int, default=1)
parser.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16",
                    help="with --decode or --ragged: the cache as stored (fp8: e4m3 with per-head scales)")
parser.add_argument("--page-size", type=int, default=None,
                    help="with --decode: the cache as a pool of pages of this many tokens (paged_attention); "
                    "with --ragged the pages' size")
parser.add_argument("--sinks", action="store_true", help="a sink logit per query head (the sinks operand)")
parser.add_argument("--forward-only", action="store_true", help="no backward (head dims without backward kernels)")
parser.add_argument("--peer", choices=["fa3_jax", "cudnn"], default=None,
                    help="run a peer instead: FlashAttention-3's JAX binding (plain causal or not) or, with "
                    "--decode, cuDNN through jax.nn")
args = parser.parse_args()

if args.ragged:
    from jax_flash.bench import ragged

    shape = ragged.Step("mixed", ((300, 1000),), (1, 17, 2000, 500), args.page_size or 16, head_dim=args.head_dim)
    q, k, v, *rest = ragged.problem(shape, jnp.bfloat16)[0]
    sinks = jax.random.normal(jax.random.key(2), (q.shape[1],), jnp.float32) if args.sinks else None
    scales = {}
    if args.kv_dtype == "fp8":
        (k, key_scale), (v, value_scale) = jax_flash.quantize_kv(k), jax_flash.quantize_kv(v)
        scales = dict(key_scale=key_scale, value_scale=value_scale)
    step = jax.jit(lambda q, k, v: jax_flash.ragged_paged_attention(
        q, k, v, *rest, implementation="cuda", sinks=sinks, softcap=args.softcap, local_window_size=args.window,
        **scales))  # fmt: skip
    jax.block_until_ready(step(q, k, v))
    raise SystemExit

if args.decode:
    # As in a generation step: the cache cold (256 MB written after it evict it from the L2), the
    # queries and lengths just produced (hot). Profile with --cache-control none to keep that.
    batch, cache = args.decode
    keys = jax.random.split(jax.random.key(0), 3)
    k, v = (jax.random.normal(key, (batch, cache, 8, args.head_dim), jnp.bfloat16) for key in keys[1:])
    jax.block_until_ready(jnp.ones((64 * 2**20,), jnp.float32) * 2)
    q = jax.random.normal(keys[0], (batch, args.queries, 32, args.head_dim), jnp.bfloat16)
    lengths = jnp.full((batch,), cache)
    sinks = jax.random.normal(jax.random.key(2), (q.shape[2],), jnp.float32) if args.sinks else None
    scales = {}
    if args.kv_dtype == "fp8":
        (k, key_scale), (v, value_scale) = jax_flash.quantize_kv(k), jax_flash.quantize_kv(v)
        scales = dict(key_scale=key_scale, value_scale=value_scale)
    if args.peer == "cudnn":
        step = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                                                    implementation="cudnn"))
    elif args.page_size:
        # Sequence b owns pages b * per_seq ... in order, the pool holding exactly the batch's pages.
        per_seq = -(-cache // args.page_size)
        pad = per_seq * args.page_size - cache
        k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(batch * per_seq, args.page_size,
                                                                        *x.shape[2:]) for x in (k, v))
        pages = jnp.arange(batch * per_seq, dtype=jnp.int32).reshape(batch, per_seq)
        step = jax.jit(lambda q, k, v: jax_flash.paged_attention(q, k, v, lengths, pages, is_causal=True,
                                                                 implementation="cuda", sinks=sinks, **scales))
    else:
        step = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True, implementation="cuda",
                                                           key_value_seq_lengths=lengths, sinks=sinks,
                                                           **scales))
    jax.block_until_ready(step(q, k, v))
    raise SystemExit

dims = (-(-args.tokens // args.seqlen), args.seqlen, 2048 // args.head_dim, args.head_dim)
q, k, v, do = (jax.random.normal(key, dims, jnp.bfloat16) for key in jax.random.split(jax.random.key(0), 4))
masks = {}
if args.masks or args.lengths:
    batch, seqlen = dims[:2]
    lengths = jnp.full((batch,), seqlen, jnp.int32).at[-1].set(seqlen * 2 // 3)
    masks = dict(query_seq_lengths=lengths, key_value_seq_lengths=lengths.at[0].set(seqlen - 100))
if args.masks:
    documents = jnp.broadcast_to(jnp.arange(seqlen, dtype=jnp.int32) * 4 // seqlen, (batch, seqlen))
    masks.update(q_segment_ids=documents, kv_segment_ids=documents)


sinks = jax.random.normal(jax.random.key(2), (dims[2],), jnp.float32) if args.sinks else None
window = None if args.window is None else (args.window, 0 if args.causal else args.window)
batch, seqlen, heads = dims[:3]
bias_keys = jax.random.split(jax.random.key(1))
bias = jax.random.normal(bias_keys[0], (1, heads, seqlen, seqlen), jnp.bfloat16) if args.bias else None
mask = jax.random.bernoulli(bias_keys[1], 0.8, (batch, 1, seqlen, seqlen)) if args.bias and args.masks else None


def attention(q, k, v, bias):
    if args.peer == "fa3_jax":
        from flash_attn3_jax import flash_mha

        return flash_mha(q, k, v, is_causal=args.causal)
    return jax_flash.attention(q, k, v, bias, mask, is_causal=args.causal, implementation="cuda",
                               softcap=args.softcap, local_window_size=window, sinks=sinks, **masks)


@jax.jit
def fwd_bwd(q, k, v, bias, do):
    if args.forward_only:
        return attention(q, k, v, bias)
    out, vjp = jax.vjp(attention, q, k, v, bias)
    return out, vjp(do)


jax.block_until_ready(fwd_bwd(q, k, v, bias, do))
