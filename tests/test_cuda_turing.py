"""The Turing family (sm_75: cuda/launch/run_sm75.cuh), forced on this GPU (JAX_FLASH_KERNELS=sm75)
with the instructions a T4 runs (mma.sync m16n8k8, loads and stores in place of cp.async) and its
tiles within 64 KB of shared memory. Every fp16 check of the other GPU tests at head dims up to 128
runs it too (test_cuda.families_for); these add its masks and lengths in float16, its refusals, and
its speed beside the sm80 kernels. Marked `gpu`."""

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import _plan
from tests import reference
from tests.cases import qkv, rng_for
from tests.test_cuda import _custom_call_targets, check
from tests.test_cuda_masks import _lengths, _packed
from tests.timing import rested_seconds

pytestmark = pytest.mark.gpu
TURING = ("sm75",)

MASKS = {
    "lengths causal": lambda rng, b, t, s: dict(query_seq_lengths=_lengths(rng, b, t),
                                                key_value_seq_lengths=_lengths(rng, b, s), is_causal=True),
    "key lengths, window": lambda rng, b, t, s: dict(key_value_seq_lengths=_lengths(rng, b, s),
                                                     local_window_size=(150, 40)),
    "segments causal": lambda rng, b, t, s: dict(q_segment_ids=_packed(rng, b, t, 3),
                                                 kv_segment_ids=_packed(rng, b, s, 3), is_causal=True),
    "soft cap, lengths": lambda rng, b, t, s: dict(softcap=5.0, scale=0.5, query_seq_lengths=_lengths(rng, b, t)),
}  # fmt: skip


@pytest.mark.parametrize("h", [64, 96, 128])
@pytest.mark.parametrize("mask", MASKS)
def test_masks_and_lengths(h, mask):
    """GQA (8 heads over 2), T != S with tails, and an empty row (lengths 0) among the rows."""
    rng = rng_for("turing-masks", h, mask)
    b, t, s = 3, 700, 900
    check(jnp.float16, b, t, s, 8, 2, h, families=TURING, **MASKS[mask](rng, b, t, s))


@pytest.mark.parametrize("t,s", [(4097, 4097), (1, 4097), (4097, 129), (7, 7)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_long_and_short_rows(t, s, is_causal):
    check(jnp.float16, 1, t, s, 2, 1, 128, families=TURING, is_causal=is_causal)


def test_the_family_reaches_the_kernels(monkeypatch):
    """Forced, the custom calls carry the Turing family (75), which the dispatch runs or refuses."""
    monkeypatch.setenv(_plan.KERNELS_ENV, "sm75")
    q, k, v = qkv(rng_for("turing-attr"), jnp.float16, 1, 256, 256, 2, 2, 64)
    fwd = _custom_call_targets(lambda q, k, v: jax_flash.attention(q, k, v, implementation="cuda"), q, k, v)
    grad = _custom_call_targets(jax.grad(
        lambda q, k, v: jax_flash.attention(q, k, v, implementation="cuda").astype(jnp.float32).sum()), q, k, v)
    assert "jax_flash_fwd" in fwd and "kernels = 75 : i32" in fwd
    assert "jax_flash_bwd" in grad and "kernels = 75 : i32" in grad


@pytest.mark.parametrize("case", ["bfloat16", "head dim 192", "bias"])
def test_what_the_family_refuses_takes_another_path(monkeypatch, case):
    """As on a T4: auto mode computes it on another path (here cuDNN or xla), implementation="cuda"
    raises."""
    monkeypatch.setenv(_plan.KERNELS_ENV, "sm75")
    dtype = jnp.bfloat16 if case == "bfloat16" else jnp.float16
    h = 192 if case == "head dim 192" else 64
    q, k, v = qkv(rng_for("turing-refused", case), dtype, 2, 300, 300, 4, 2, h)
    bias = jnp.asarray(rng_for("turing-bias").normal(size=(1, 4, 300, 300)), jnp.float32) if case == "bias" else None
    assert jax_flash.chosen_implementation(q, k, v, bias=bias, is_causal=True) != "cuda"
    with pytest.raises(ValueError, match="on Turing"):
        jax_flash.attention(q, k, v, bias, implementation="cuda", is_causal=True)
    out = jax.jit(lambda q, k, v, bias: jax_flash.attention(q, k, v, bias, is_causal=True))(q, k, v, bias)
    expected, _ = reference.attention(q, k, v, bias, is_causal=True)
    assert reference.rel_error(out, expected) < 1e-2


@pytest.mark.timing
def test_forward_speed_beside_the_sm80_kernels():
    """Issue 50's smoke figure: the Turing forward on this GPU at least 0.4x the sm80 forward, fp16,
    d = 128, 4k causal and not (on a T4 it cannot be timed here). Its loads wait in registers where
    cp.async would not, and each k16 step is two m16n8k8."""
    q, k, v = qkv(rng_for("turing-speed"), jnp.float16, 4, 4096, 4096, 16, 16, 128)
    for is_causal in (False, True):
        seconds = {}
        for family in ("sm80", "sm75"):
            # The family is read when traced: a function of its own for each (jax caches traces
            # by function).
            def forward(q, k, v, is_causal=is_causal, family=family):
                return jax_flash.attention(q, k, v, implementation="cuda", is_causal=is_causal)

            with pytest.MonkeyPatch.context() as env:
                env.setenv(_plan.KERNELS_ENV, family)
                seconds[family] = rested_seconds(jax.jit(forward), (q, k, v))
        ratio = seconds["sm80"] / seconds["sm75"]
        print(f"causal={is_causal}: sm75 {seconds['sm75'] * 1e3:.2f} ms, sm80 {seconds['sm80'] * 1e3:.2f} ms, "
              f"{ratio:.2f}x")
        assert ratio >= 0.4, f"causal={is_causal}: the Turing forward at {ratio:.2f}x the sm80 one"
