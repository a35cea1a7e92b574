"""Cost of masks and of the soft cap: `python -m jax_flash.bench --masks`.

One long row (16384 tokens, 16 heads, d = 128 or each of `--head-dims`, bf16 on a GPU; 1024 tokens
on a CPU) under each mask, timed forward and forward + backward, as a fraction of the causal time.
Work should follow the unmasked area: a 512-token window is 1/16 of the causal area at 16k, eight
packed causal documents 1/8, half-length padded keys about 1/4. The soft cap adds a tanh per logit to the
causal case, a [T, S] bias or boolean mask (shared by the heads) a load per logit, and a
learned bias also its gradient (an add per logit into dbias): their fractions are their costs. A
padding mask hiding the second half of the keys leaves 0.75 of the causal area (the first half of
the queries see their causal keys, the second half the first 8k).

On a GPU the peers that take a window (cuDNN through `jax.nn.dot_product_attention` and, when it
imports, FlashAttention-3's JAX binding) run the causal and window cases too, each as a fraction
of its own causal time: what the same window costs where it is not our kernels.

The cases are timed as the main benchmark times implementations (timing.measure): every case
once a round, the order reversed every other round, and a fraction is the median of the rounds'
fractions. Timed one case after the other, causal (first) ran on a cool GPU at its highest clocks
and every later case on a warm one, which overstated the fractions by up to 15%.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash.bench.timing import Shape, measure, peers


def cases(seqlen: int, dtype) -> dict[str, dict]:
    documents = jnp.repeat(jnp.arange(8, dtype=jnp.int32), seqlen // 8)[None]
    bias = jax.random.normal(jax.random.key(1), (1, 1, seqlen, seqlen), dtype)
    return {
        "causal": dict(is_causal=True),
        "window 512 (causal)": dict(is_causal=True, local_window_size=(511, 0)),
        "8 packed documents (causal)": dict(is_causal=True, q_segment_ids=documents, kv_segment_ids=documents),
        "keys padded to half (causal)": dict(is_causal=True,
                                             key_value_seq_lengths=jnp.asarray([seqlen // 2], jnp.int32)),
        "softcap 30 (causal)": dict(is_causal=True, softcap=30.0),
        "bias [1, 1, T, S] (causal)": dict(is_causal=True, bias=bias),
        "learned bias [1, 1, T, S] (causal)": dict(is_causal=True, bias=bias, learned=True),
        "boolean mask [1, 1, T, S] (causal)": dict(is_causal=True, mask=bias > -2.0),
        "padding mask [1, 1, 1, S], half (causal)": dict(is_causal=True,
                                                        mask=(jnp.arange(seqlen) < seqlen // 2)[None, None, None]),
    }


def _ours(kw: dict):
    """jax_flash.attention on a case; a `learned` bias gets a gradient (the backward then writes
    dbias, as when the bias is trained) through a zero multiple of q, which the timed gradient
    (with respect to q, k and v) differentiates."""
    kw = dict(kw)
    if not kw.pop("learned", False):
        return lambda q, k, v, causal: jax_flash.attention(q, k, v, **kw)
    bias = kw.pop("bias")
    return lambda q, k, v, causal: jax_flash.attention(q, k, v, bias=bias + 0 * q[0, 0, 0, 0], **kw)


# The cases the peers run (they take no segment ids, cap or bias here).
PEER_CASES = ("causal", "window 512 (causal)")


def run(head_dim: int = 128) -> list[dict]:
    """One row per case: median forward and forward + backward seconds, and the rounds' fractions
    of causal (`fwd_rounds`, `fwd_bwd_rounds`); a peer's rows ("peer: case") are fractions of the
    peer's own causal row."""
    on_gpu = jax.default_backend() == "gpu"
    # On a CPU the smallest grid that still runs every case (CI time): the window then spans it.
    seqlen, heads, dtype = (16384, 16, jnp.bfloat16) if on_gpu else (128, 2, jnp.float32)
    shape = Shape(head_dim=head_dim, seqlen=seqlen, causal=True, batch=1, heads=heads)
    ours = cases(seqlen, dtype)
    attns = {name: _ours(kw) for name, kw in ours.items()}
    causal_of = dict.fromkeys(ours, "causal")  # case -> the case its fractions divide by
    for peer, attn in peers(on_gpu).items():
        for name in PEER_CASES:
            attns[f"{peer}: {name}"] = lambda q, k, v, causal, kw=ours[name], attn=attn: attn(q, k, v, **kw)
            causal_of[f"{peer}: {name}"] = f"{peer}: causal"
    samples = measure(attns, shape, dtype)  # name -> [(fwd, bwd) seconds per round]
    fwd = {name: [f for f, _ in rounds] for name, rounds in samples.items()}
    fwd_bwd = {name: [None if b is None else f + b for f, b in rounds] for name, rounds in samples.items()}
    rows = []
    for name in attns:
        base = causal_of[name]
        if None in fwd[name] + fwd_bwd[name] + fwd[base] + fwd_bwd[base]:
            continue  # failed on these inputs (timing.measure): a gap, as in the main table
        rows.append({"case": name, "seqlen": seqlen, "head_dim": head_dim,
                     "fwd": statistics.median(fwd[name]), "fwd_bwd": statistics.median(fwd_bwd[name]),
                     "fwd_rounds": [a / b for a, b in zip(fwd[name], fwd[base])],
                     "fwd_bwd_rounds": [a / b for a, b in zip(fwd_bwd[name], fwd_bwd[base])]})
    return rows


def table(rows: list[dict]) -> str:
    """The fractions are medians of the rounds' fractions, with their range."""
    fraction = lambda rounds: f"{statistics.median(rounds):.3f} ({min(rounds):.3f}–{max(rounds):.3f})"  # noqa: E731
    lines = ["| mask | fwd ms | fwd + bwd ms | fwd / causal (range) | fwd + bwd / causal (range) |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['fwd'] * 1e3:.2f} | {r['fwd_bwd'] * 1e3:.2f} | "
                     f"{fraction(r['fwd_rounds'])} | {fraction(r['fwd_bwd_rounds'])} |")
    return "\n".join(lines)
