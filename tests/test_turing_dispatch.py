"""Which calls the Turing family (sm_75, cuda/launch/run_sm75.cuh) takes, on CPU: a stand-in for
the kernels (fake_kernels) on a 7.5 GPU, or on Hopper with the family forced (JAX_FLASH_KERNELS=sm75,
how the GPU tests run it). float16 at head dims up to 128 (padded to 64, 96 or 128), no bias; the
rest takes another path in auto mode, and implementation="cuda" says why."""

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import _decode, _ffi, _plan, dense_impl
from tests import fake_kernels, reference
from tests.cases import qkv, rng_for


@pytest.fixture
def turing_calls(monkeypatch):
    """A 7.5 GPU with the default build; every kernel call recorded."""
    calls = fake_kernels.record_calls(monkeypatch)
    monkeypatch.setattr(_ffi, "device_capability", lambda: (7, 5))
    monkeypatch.setattr(dense_impl, "budget_bytes", lambda: -1)  # the stand-in's blockwise path
    return calls


def _loss(implementation, **kw):
    def loss(q, k, v):
        out = jax_flash.attention(q, k, v, implementation=implementation, **kw)
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size).reshape(out.shape)))

    return loss


@pytest.mark.parametrize("h,padded", [(32, 64), (64, 64), (80, 96), (96, 96), (128, 128)])
@pytest.mark.parametrize("where", ["turing", "forced on hopper"])
def test_float16_up_to_128_takes_the_turing_kernels(turing_calls, monkeypatch, h, padded, where):
    if where == "forced on hopper":
        monkeypatch.setattr(_ffi, "device_capability", lambda: (9, 0))
        monkeypatch.setenv(_plan.KERNELS_ENV, "sm75")
    q, k, v = qkv(rng_for("turing-dispatch", h, where), jnp.float16, 2, 40, 56, 4, 2, h)
    kw = dict(is_causal=True, local_window_size=(20, 0), softcap=20.0)
    assert jax_flash.chosen_implementation(q, k, v, **kw) == "cuda"
    out = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, implementation="cuda", **kw))(q, k, v)
    grads = jax.jit(jax.grad(_loss("cuda", **kw), (0, 1, 2)))(q, k, v)
    (fwd_target, fwd_shapes), *_, (bwd_target, bwd_shapes) = turing_calls
    assert (fwd_target, fwd_shapes[0], bwd_target, bwd_shapes[0]) == (
        "jax_flash_fwd", (2, 40, 4, padded), "jax_flash_bwd", (2, 40, 4, padded))
    # The plan names the Turing family, on its own GPU or forced on Hopper.
    assert int(turing_calls.attrs["jax_flash_fwd"]["family"]) == _plan.Family.TURING
    assert int(turing_calls.attrs["jax_flash_bwd"]["family"]) == _plan.Family.TURING
    xla = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, implementation="xla", **kw))(q, k, v)
    assert reference.rel_error(out, xla) < 1e-2
    for mine, ref in zip(grads, jax.jit(jax.grad(_loss("xla", **kw), (0, 1, 2)))(q, k, v), strict=True):
        assert reference.rel_error(mine, ref) < 2e-2


@pytest.mark.parametrize("case,reason", [
    ("bfloat16", "float16 only"), ("head dim 160", "head dims up to 128"), ("bias", "no bias"),
    ("mask over queries and keys", "no mask that varies along both"),
])  # fmt: skip
def test_what_the_turing_kernels_do_not_take(turing_calls, case, reason):
    dtype = jnp.bfloat16 if case == "bfloat16" else jnp.float16
    h = 160 if case == "head dim 160" else 64
    q, k, v = qkv(rng_for("turing-refused", case), dtype, 1, 16, 16, 2, 2, h)
    bias = jnp.zeros((1, 2, 16, 16), jnp.float32) if case == "bias" else None
    mask = jnp.tril(jnp.ones((16, 16), bool))[None, None] if case == "mask over queries and keys" else None
    # Auto mode: cuDNN where jax.nn's takes it (not on this CPU: test_cudnn_fallback.py), else xla.
    assert jax_flash.chosen_implementation(q, k, v, bias=bias, mask=mask).startswith("xla")
    with pytest.raises(ValueError, match=reason):
        jax_flash.attention(q, k, v, bias, mask, implementation="cuda")
    assert not turing_calls


def test_a_padding_mask_runs_as_segment_ids(turing_calls):
    q, k, v = qkv(rng_for("turing-padding-mask"), jnp.float16, 2, 40, 56, 4, 2, 64)
    mask = jnp.asarray(rng_for("turing-padding-mask-values").random((2, 1, 1, 56)) > 0.3)
    out = jax_flash.attention(q, k, v, mask=mask, implementation="cuda")
    assert reference.rel_error(out, jax_flash.attention(q, k, v, mask=mask, implementation="xla")) < 1e-2
    assert [target for target, _ in turing_calls] == ["jax_flash_fwd"]


def test_decode_and_paged_calls_take_the_forward_kernels(turing_calls, monkeypatch):
    """No decode kernels on Turing (they are written in sm_80's mma.sync): a short query takes the
    forward kernel, a paged cache is gathered first."""
    monkeypatch.setattr(_decode, "sm_count", lambda: 40)
    q, k, v = qkv(rng_for("turing-decode"), jnp.float16, 2, 1, 256, 8, 2, 128)
    lengths = jnp.array([200, 256], jnp.int32)
    out = jax_flash.attention(q, k, v, key_value_seq_lengths=lengths, implementation="cuda")
    expected = jax_flash.attention(q, k, v, key_value_seq_lengths=lengths, implementation="xla")
    assert reference.rel_error(out, expected) < 1e-2
    pages_k, pages_v = (x.reshape(2 * 16, 16, 2, 128) for x in (k, v))
    table = jnp.arange(32, dtype=jnp.int32).reshape(2, 16)
    paged = jax_flash.paged_attention(q, pages_k, pages_v, lengths, table)
    assert reference.rel_error(paged, expected) < 1e-2
    assert {target for target, _ in turing_calls} == {"jax_flash_fwd"}


@pytest.mark.parametrize("capability,turing_archs,forced,reason", [
    ((7, 0), ("75", "90a"), None, "compute capability 7.5 or newer"),
    # Built for Hopper with the test families: the Turing family's code is sm_90a's alone.
    ((7, 5), ("90a",), None, "Turing kernels have machine code for sm_90a, none of which runs"),
    ((8, 0), ("75", "90a"), "sm75", "Turing kernels have machine code for sm_75, sm_90a, none"),
    # Without the test families (the default build) Hopper has no Turing code to force.
    ((9, 0), ("75",), "sm75", "Turing kernels have machine code for sm_75, none of which runs on this GPU \\(9.0\\)"),
])  # fmt: skip
def test_no_turing_kernels_without_their_code(turing_calls, monkeypatch, capability, turing_archs, forced, reason):
    monkeypatch.setattr(_ffi, "device_capability", lambda: capability)
    monkeypatch.setattr(_ffi, "family_archs", lambda: {**fake_kernels.TEST_BUILD_FAMILY_ARCHS, "turing": turing_archs})
    if forced:
        monkeypatch.setenv(_plan.KERNELS_ENV, forced)
    q, k, v = qkv(rng_for("turing-no-code", capability), jnp.float16, 1, 16, 16, 2, 2, 64)
    assert jax_flash.chosen_implementation(q, k, v).startswith("xla")
    with pytest.raises(ValueError, match=reason):
        jax_flash.attention(q, k, v, implementation="cuda")


def test_the_turing_backward_is_weighed_against_its_shared_memory(turing_calls, monkeypatch):
    """64 KB a block on sm_75 (its kernels fit it: test_the_turing_kernels_fit_64_kb); a smaller
    limit forced for a test sends the gradients to the xla path."""
    monkeypatch.setattr(_ffi.extension(), "sm75_backward_smem_bytes", lambda head_dim: 57856)
    assert _ffi.smem_limit() == 65536 and _plan.backward_kernels_fit(_plan.family(), 128)
    monkeypatch.setenv(_ffi.SMEM_LIMIT_ENV, "49152")
    assert not _plan.backward_kernels_fit(_plan.family(), 128)


def test_the_turing_kernels_fit_64_kb():
    """The compiled module's shared memory a block of the Turing family (cuda/sm80/config.cuh with
    Isa::kSm75): within sm_75's 64 KB at 64, 96 and 128, and no kernel at other head dims. Needs the
    compiled extension (CI's first environment builds it; no GPU needed)."""
    module = _ffi.extension()
    if module is None:
        pytest.skip("the CUDA extension is not built in this environment")
    turing = _ffi.SMEM_OPTIN_BY_CAPABILITY[(7, 5)]
    for head_dim in (64, 96, 128):
        assert 0 < module.sm75_forward_smem_bytes(head_dim) <= turing, head_dim
        assert 0 < module.sm75_backward_smem_bytes(head_dim) <= turing, head_dim
    assert module.sm75_forward_smem_bytes(32) == module.sm75_backward_smem_bytes(256) == 0
