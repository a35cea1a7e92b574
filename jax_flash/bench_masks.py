"""Cost of masks and of the soft cap: `python -m jax_flash.bench --masks`.

One long row (16384 tokens, d = 128, 16 heads, bf16 on a GPU; 1024 tokens on a CPU) under each
mask, timed forward and forward + backward, as a fraction of the causal time. Work should follow
the unmasked area: a 512-token window is 1/16 of the causal area at 16k, eight packed causal
documents 1/8, half-length padded keys about 1/4. The soft cap adds a tanh per logit to the
causal case, a [T, S] bias or boolean mask (shared by the heads) a load per logit: their
fractions are their costs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash.bench import fwd_and_fwd_bwd_seconds


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
        "boolean mask [1, 1, T, S] (causal)": dict(is_causal=True, mask=bias > -2.0),
    }


def run() -> list[dict]:
    on_gpu = jax.default_backend() == "gpu"
    seqlen, heads, dtype = (16384, 16, jnp.bfloat16) if on_gpu else (1024, 2, jnp.float32)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(key, (1, seqlen, heads, 128), dtype) for key in keys)
    rows = []
    for name, kw in cases(seqlen, dtype).items():
        fwd, fwd_bwd = fwd_and_fwd_bwd_seconds(lambda q, k, v, kw=kw: jax_flash.attention(q, k, v, **kw),
                                               (q, k, v, do))
        rows.append({"case": name, "seqlen": seqlen, "fwd": fwd, "fwd_bwd": fwd_bwd})
    return rows


def table(rows: list[dict]) -> str:
    base = rows[0]
    lines = ["| mask | fwd ms | fwd + bwd ms | fwd / causal | fwd + bwd / causal |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['fwd'] * 1e3:.2f} | {r['fwd_bwd'] * 1e3:.2f} | "
                     f"{r['fwd'] / base['fwd']:.3f} | {r['fwd_bwd'] / base['fwd_bwd']:.3f} |")
    return "\n".join(lines)
