"""Ring attention's overlap of communication with compute: `python -m jax_flash.bench --ring`.

On P >= 2 GPUs, one sequence of P x L tokens (L per device, 32768 unless --ring-seqlen; 16 heads,
d = 128, bf16) sharded over a ring: `ring_attention` forward and forward + backward against the
time one GPU takes for the block pairs one device of the ring computes. Non-causal that is L
queries against all P x L keys; causal (zigzag layout: every device the same share) the causal
problem of P x L tokens divided by P. A ratio near 1 means the ring's permutes hide under the
compute (issue 7 asks <= 1.2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from jax_flash._partition import shard_map
from jax_flash.bench.timing import fwd_and_fwd_bwd_seconds


def run(per_device: int = 32768, heads: int = 16, head_dim: int = 128) -> list[dict]:
    gpus = jax.devices("gpu") if jax.default_backend() == "gpu" else []
    if len(gpus) < 2:
        raise SystemExit("--ring needs 2 or more GPUs")
    ring_size, total = len(gpus), len(gpus) * per_device
    mesh = jax.make_mesh((ring_size,), ("sp",), axis_types=(AxisType.Auto,), devices=gpus)
    spec = P(None, "sp", None, None)
    q, k, v, do = (jax.random.normal(key, (1, total, heads, head_dim), jnp.bfloat16)
                   for key in jax.random.split(jax.random.key(0), 4))  # fmt: skip
    sharded = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, do)]
    on_one = [jax.device_put(x, gpus[0]) for x in (q, k, v, do)]
    rows = []
    for causal in (False, True):
        def local(q, k, v, causal=causal):
            return jax_flash.ring_attention(q, k, v, axis_name="sp", is_causal=causal)

        ring = shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        ring_times = fwd_and_fwd_bwd_seconds(ring, sharded)
        if causal:  # the whole causal problem on one GPU, a ring member's share of it
            one = fwd_and_fwd_bwd_seconds(lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True), on_one)
            one = tuple(t / ring_size for t in one)
        else:  # one device's queries against every key
            q_local, do_local = on_one[0][:, :per_device], on_one[3][:, :per_device]
            one = fwd_and_fwd_bwd_seconds(jax_flash.attention, [q_local, on_one[1], on_one[2], do_local])
        for name, ring_s, one_s in zip(("fwd", "fwd + bwd"), ring_times, one):
            rows.append({"case": "causal" if causal else "full", "pass": name, "ring_size": ring_size,
                         "tokens_per_device": per_device, "ring": ring_s, "one_gpu": one_s})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| mask | pass | ring ms | one GPU, a member's block pairs, ms | ring / one GPU |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['pass']} | {r['ring'] * 1e3:.2f} | {r['one_gpu'] * 1e3:.2f} | "
                     f"{r['ring'] / r['one_gpu']:.3f} |")
    return "\n".join(lines)
