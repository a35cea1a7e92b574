"""The part the nnx and linen modules share: RoPE, then attention with only the extras set."""

from __future__ import annotations

from jax_flash.flax.rotary import apply_rotary


def attend(module, q, k, v, positions, segment_ids):
    """q: [batch..., T, N, H], k/v: [batch..., S, K, H] -> [batch..., T, N, H]. Extras that are
    unset are not passed, so `module.attention` may be jax.nn.dot_product_attention too."""
    if module.rope:
        q = apply_rotary(q, positions, module.rope_base)
        k = apply_rotary(k, positions, module.rope_base)
    extras = {}
    if module.softcap is not None:
        extras["softcap"] = module.softcap
    if segment_ids is not None:
        extras.update(q_segment_ids=segment_ids, kv_segment_ids=segment_ids)
    return module.attention(q, k, v, is_causal=module.is_causal,
                            local_window_size=module.local_window_size, **extras)  # fmt: skip
