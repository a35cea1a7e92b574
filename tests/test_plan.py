"""The kernel plan's rules (jax_flash/_plan.py): which family a GPU runs, and that the family the
plan picks is the one each custom call names (the handlers follow it, dispatch.cu)."""

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import _ffi, _plan
from jax_flash._plan import Family
from tests import fake_kernels
from tests.cases import qkv, rng_for

CAPABILITIES = [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]
ARCHS = [("75", "80", "90a", "80-virtual"), ("80", "80-virtual"), ("90a",)]


def _expected(capability, archs, forced) -> Family:
    """The rule in words: forced wins; else Turing on 7.x, Hopper's on 9.0 where sm_90a code is
    built, the mma.sync kernels everywhere else."""
    if forced is not None:
        return forced
    if capability[0] == 7:
        return Family.TURING
    return Family.HOPPER if capability == (9, 0) and "90a" in archs else Family.MMA_SYNC


@pytest.mark.parametrize("forced", [None, "best", "sm80", "sm75"])
@pytest.mark.parametrize("archs", ARCHS)
@pytest.mark.parametrize("capability", CAPABILITIES)
def test_the_family_of_each_gpu(monkeypatch, capability, archs, forced):
    if forced is None:
        monkeypatch.delenv(_plan.KERNELS_ENV, raising=False)
    else:
        monkeypatch.setenv(_plan.KERNELS_ENV, forced)
    assert _plan.family_of(capability, archs) is _expected(capability, archs, _plan.FORCED_FAMILIES.get(forced))


def test_the_families_are_the_handlers_values():
    """dispatch.h's KernelFamily: kTuring = 75, kMmaSync = 80, kHopper = 90."""
    assert {f.name: int(f) for f in Family} == {"TURING": 75, "MMA_SYNC": 80, "HOPPER": 90}


@pytest.mark.parametrize("capability,forced,family", [
    ((9, 0), None, Family.HOPPER), ((9, 0), "sm80", Family.MMA_SYNC), ((8, 0), None, Family.MMA_SYNC),
    ((9, 0), "sm75", Family.TURING),
])  # fmt: skip
def test_each_call_names_the_plans_family(monkeypatch, capability, forced, family):
    """The forward's and backward's `family` attribute is the plan's, so that dispatch.cu does not
    decide again; the decode call (mma.sync alone) has none."""
    calls = fake_kernels.record_calls(monkeypatch)
    monkeypatch.setattr(_ffi, "device_capability", lambda: capability)
    if forced:
        monkeypatch.setenv(_plan.KERNELS_ENV, forced)
    else:
        monkeypatch.delenv(_plan.KERNELS_ENV, raising=False)
    q, k, v = qkv(rng_for("plan", capability, forced), jnp.float16, 2, 40, 40, 4, 2, 64)
    jax.grad(lambda q: jax_flash.attention(q, k, v, implementation="cuda").astype(jnp.float32).sum())(q)
    assert calls.attrs["jax_flash_fwd"]["family"] == family
    assert calls.attrs["jax_flash_bwd"]["family"] == family


def test_an_unknown_family_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(_plan.KERNELS_ENV, "hopper")
    with pytest.raises(ValueError, match="JAX_FLASH_KERNELS must be one of"):
        _plan.family()


@pytest.mark.parametrize(
    "family, query_shape, value_dim, bias_or_2d_mask, beyond_key_lengths, expected",
    [
        (Family.HOPPER, (2, 512, 8, 192), 128, False, False, (192, 128)),  # MLA's pair, its own kernel
        (Family.HOPPER, (2, 512, 8, 192), 128, True, True, (192, 192)),  # a bias: the widest's for both
        (Family.HOPPER, (2, 1, 8, 192), 128, False, False, (192, 192)),  # decode reads at the wider dim
        (Family.HOPPER, (2, 1, 8, 192), 128, False, True, (192, 128)),  # query lengths: off the decode kernels
        (Family.MMA_SYNC, (2, 512, 8, 192), 128, False, False, (192, 192)),  # the pair is Hopper's alone
        (Family.HOPPER, (2, 512, 8, 80), 80, False, False, (96, 96)),
        (Family.TURING, (2, 512, 8, 80), 48, False, False, (96, 96)),
    ],
)
def test_forward_head_dims_are_decided_once_from_the_call(family, query_shape, value_dim, bias_or_2d_mask,
                                                          beyond_key_lengths, expected):  # fmt: skip
    got = _plan.forward_head_dims(family, query_shape, 2, value_dim, bias_or_2d_mask, beyond_key_lengths)
    assert got == expected


@pytest.mark.parametrize(
    "query_shape, value_dim, bias_or_2d_mask, beyond_key_lengths, expected",
    [
        # A decode step: the split-KV kernels forward, the 128 backward kernels for its gradient.
        ((2, 1, 32, 128), 128, False, False, _plan.KernelPlan(Family.HOPPER, (128, 128), True, (128, 128), True)),
        # Query lengths keep it on the forward kernels.
        ((2, 1, 32, 128), 128, False, True, _plan.KernelPlan(Family.HOPPER, (128, 128), False, (128, 128), True)),
        # MLA's pair forward and backward; with a bias, 192 forward and the 256 backward padded.
        ((2, 512, 8, 192), 128, False, False, _plan.KernelPlan(Family.HOPPER, (192, 128), False, (192, 128), True)),
        ((2, 512, 8, 192), 128, True, True, _plan.KernelPlan(Family.HOPPER, (192, 192), False, (256, 256), True)),
        # Above 256: the forward alone.
        ((2, 512, 8, 512), 512, False, False, _plan.KernelPlan(Family.HOPPER, (512, 512), False, None, False)),
    ],
)
def test_one_plan_a_call(query_shape, value_dim, bias_or_2d_mask, beyond_key_lengths, expected):
    got = _plan.kernel_plan(Family.HOPPER, query_shape, 8, value_dim, bias_or_2d_mask, beyond_key_lengths)
    assert got == expected
