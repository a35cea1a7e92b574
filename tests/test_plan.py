"""The kernel plan's rules (jax_flash/_plan.py): which family a GPU runs, and that the family the
plan picks is the one each custom call names (the handlers follow it, dispatch.cu)."""

import functools
import types

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
    dims, decode = _plan.forward_plan(family, query_shape, 2, value_dim, bias_or_2d_mask, beyond_key_lengths)
    assert dims == expected
    # The decode kernels take one query of equal dims, key lengths alone, from sm_80 on.
    assert decode == (query_shape[1] == 1 and dims[0] == dims[1] and not beyond_key_lengths
                      and family is not Family.TURING)


Tiles, Traits = _plan.Tiles, _plan.TileTraits
HOPPER_PLAN = functools.partial(_plan.KernelPlan, Family.HOPPER)


@pytest.mark.parametrize(
    "query_shape, value_dim, bias_or_2d_mask, beyond_key_lengths, traits, expected",
    [
        # A decode step: the split-KV kernels forward, the 128 backward kernels for its gradient.
        ((2, 1, 32, 128), 128, False, False, Traits(),
         HOPPER_PLAN((128, 128), True, (128, 128), True, Tiles.USUAL, Tiles.STEPS_OF_80)),
        # Query lengths keep it on the forward kernels.
        ((2, 1, 32, 128), 128, False, True, Traits(lengths=True),
         HOPPER_PLAN((128, 128), False, (128, 128), True, Tiles.WIDE_KEYS, Tiles.USUAL)),
        # MLA's pair forward and backward; with a bias, 192 forward and the 256 backward padded.
        ((2, 512, 8, 192), 128, False, False, Traits(), HOPPER_PLAN((192, 128), False, (192, 128), True)),
        ((2, 512, 8, 192), 128, True, True, Traits(bias_or_mask=True), HOPPER_PLAN((192, 192), False, (256, 256), True)),
        # Above 256: the forward alone.
        ((2, 512, 8, 512), 512, False, False, Traits(), HOPPER_PLAN((512, 512), False, None, False)),
    ],
)  # fmt: skip
def test_one_plan_a_call(query_shape, value_dim, bias_or_2d_mask, beyond_key_lengths, traits, expected):
    got = _plan.kernel_plan(Family.HOPPER, query_shape, 8, value_dim, bias_or_2d_mask, beyond_key_lengths, traits)
    assert got == expected


def test_the_tiles_are_the_launchers_values():
    """contract.h's Tiles, which the launchers switch on, from the same table."""
    assert {t.name: int(t) for t in Tiles} == {"USUAL": 0, "TALL": 1, "WIDE_KEYS": 2, "STEPS_OF_80": 3, "COMPACT": 4}


CAUSAL, WINDOW = dict(window_left=None, window_right=0), dict(window_left=128, window_right=0)


@pytest.mark.parametrize("head_dim, seqlen_q, traits, expected", [
    (64, 4096, Traits(), Tiles.TALL),  # no band: 192 query rows
    (64, 4096, Traits(lengths=True), Tiles.TALL),
    (64, 4096, Traits(**CAUSAL), Tiles.USUAL),  # causal under 8k: 128 rows waste less on the diagonal
    (64, 8192, Traits(**CAUSAL), Tiles.TALL),  # long causal rows
    (64, 16384, Traits(**WINDOW), Tiles.USUAL),  # a window, however long
    (64, 4096, Traits(segments=True), Tiles.USUAL),  # documents' edges
    (64, 4096, Traits(softcap=True), Tiles.USUAL),  # its tanh spilled
    (64, 4096, Traits(bias_or_mask=True), Tiles.USUAL),
    (128, 4096, Traits(**CAUSAL), Tiles.WIDE_KEYS),
    (128, 4096, Traits(softcap=True), Tiles.WIDE_KEYS),
    (128, 4096, Traits(**WINDOW), Tiles.USUAL),  # keys wasted at the window's edges
    (128, 4096, Traits(segments=True), Tiles.USUAL),
    (128, 4096, Traits(bias_or_mask=True), Tiles.USUAL),  # the wide blocks' bias loads spilled
    (256, 4096, Traits(**WINDOW, segments=True), Tiles.WIDE_KEYS),  # 80 keys against 64: nothing lost
    (256, 4096, Traits(bias_or_mask=True), Tiles.USUAL),
    (192, 4096, Traits(), Tiles.USUAL),
])  # fmt: skip
def test_the_forward_tiles(head_dim, seqlen_q, traits, expected):
    assert _plan.forward_tiles(Family.HOPPER, (head_dim, head_dim), seqlen_q, traits) is expected
    # Only the Hopper kernels at equal head dims have more than one tile shape.
    assert _plan.forward_tiles(Family.MMA_SYNC, (head_dim, head_dim), seqlen_q, traits) is Tiles.USUAL
    assert _plan.forward_tiles(Family.HOPPER, (head_dim, head_dim // 2), seqlen_q, traits) is Tiles.USUAL


@pytest.mark.parametrize("traits, expected", [
    (Traits(), Tiles.STEPS_OF_80),
    (Traits(**CAUSAL), Tiles.USUAL),  # a band
    (Traits(deterministic=True), Tiles.USUAL),  # its turns count 64-row blocks
    (Traits(lengths=True), Tiles.USUAL),
    (Traits(softcap=True), Tiles.USUAL),
    (Traits(bias_or_mask=True), Tiles.USUAL),
])  # fmt: skip
def test_the_hopper_backward_tiles(traits, expected):
    assert _plan.backward_tiles(Family.HOPPER, (128, 128), traits) is expected
    for dims in ((64, 64), (256, 256), (192, 192), (192, 128)):
        assert _plan.backward_tiles(Family.HOPPER, dims, traits) is Tiles.USUAL


@pytest.mark.parametrize("usual_bytes, expected", [(101376, Tiles.USUAL), (101377, Tiles.COMPACT)])
def test_the_mma_sync_backward_takes_the_compact_tiles_where_the_usual_do_not_fit(monkeypatch, usual_bytes, expected):
    """sm_86's limit (101376 bytes a block): the usual tiles up to it, the compact ones above; on
    Hopper the mma.sync kernels of 32 and 96 likewise, against Hopper's limit."""
    module = types.SimpleNamespace(sm80_backward_usual_smem_bytes=lambda head_dim: usual_bytes)
    monkeypatch.setattr(_ffi, "extension", lambda: module)
    monkeypatch.delenv(_ffi.SMEM_LIMIT_ENV, raising=False)
    monkeypatch.setattr(_ffi, "device_capability", lambda: (8, 6))
    assert _plan.backward_tiles(Family.MMA_SYNC, (128, 128), Traits()) is expected
    monkeypatch.setattr(_ffi, "device_capability", lambda: (9, 0))
    assert _plan.backward_tiles(Family.HOPPER, (96, 96), Traits()) is Tiles.USUAL
    monkeypatch.setenv(_ffi.SMEM_LIMIT_ENV, "101376")
    assert _plan.backward_tiles(Family.HOPPER, (96, 96), Traits()) is expected
    assert _plan.backward_tiles(Family.TURING, (96, 96), Traits()) is Tiles.USUAL


@pytest.mark.parametrize("head_dim, kwargs, forward, backward", [
    (64, dict(), Tiles.TALL, Tiles.USUAL),
    (64, dict(is_causal=True), Tiles.USUAL, Tiles.USUAL),
    (64, dict(key_value_seq_lengths=True), Tiles.TALL, Tiles.USUAL),
    (64, dict(padding_mask=True), Tiles.USUAL, Tiles.USUAL),  # runs as segment ids
    (128, dict(), Tiles.WIDE_KEYS, Tiles.STEPS_OF_80),
    (128, dict(is_causal=True), Tiles.WIDE_KEYS, Tiles.USUAL),
    (128, dict(local_window_size=(32, 32)), Tiles.USUAL, Tiles.USUAL),
    (128, dict(key_value_seq_lengths=True), Tiles.WIDE_KEYS, Tiles.USUAL),
    (128, dict(padding_mask=True), Tiles.USUAL, Tiles.USUAL),
])  # fmt: skip
def test_each_call_names_the_plans_tiles(monkeypatch, head_dim, kwargs, forward, backward):
    """The forward's and backward's `tiles` attribute is the plan's (the stand-in refuses tiles the
    launchers would: fake_kernels.launchers_take)."""
    monkeypatch.delenv(_plan.KERNELS_ENV, raising=False)
    monkeypatch.delenv(_ffi.DETERMINISTIC_ENV, raising=False)
    calls = fake_kernels.record_calls(monkeypatch)
    q, k, v = qkv(rng_for("tiles", head_dim, *kwargs), jnp.bfloat16, 2, 40, 40, 4, 2, head_dim)
    kwargs = dict(kwargs)
    if kwargs.pop("key_value_seq_lengths", False):
        kwargs["key_value_seq_lengths"] = jnp.array([40, 17], jnp.int32)
    if kwargs.pop("padding_mask", False):
        kwargs["mask"] = jnp.arange(40)[None, None, None, :] < jnp.array([40, 9])[:, None, None, None]
    jax.grad(lambda q: jax_flash.attention(q, k, v, implementation="cuda", **kwargs).astype(jnp.float32).sum())(q)
    assert calls.attrs["jax_flash_fwd"]["tiles"] == forward
    assert calls.attrs["jax_flash_bwd"]["tiles"] == backward


def test_the_stand_in_refuses_tiles_the_launchers_do_not_have():
    """fake_kernels' oracle of the launchers' refusals, so that the tests above can fail."""
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    operands = types.SimpleNamespace(q=q, v=q, bias=jnp.zeros((1, 0, 0, 0)), mask=jnp.zeros((1, 0, 0, 0)),
                                     q_segments=jnp.zeros((1, 0)), seqlens=jnp.zeros((1, 0)))  # fmt: skip
    attrs = dict(tiles=int(Tiles.WIDE_KEYS), family=int(Family.HOPPER), softcap=0.0, window_left=-1,
                 window_right=-1, deterministic=0)  # fmt: skip
    assert not fake_kernels.launchers_take("jax_flash_fwd", operands, attrs)  # 64 has no wide key blocks
    assert fake_kernels.launchers_take("jax_flash_fwd", operands, dict(attrs, tiles=int(Tiles.TALL)))
    assert not fake_kernels.launchers_take("jax_flash_bwd", operands, dict(attrs, tiles=int(Tiles.TALL)))
