"""The custom calls' operands come from one table (scripts/ffi_operands.py): the Python layer's
named tuples match what the handlers bind, and a call that does not match them is refused before
it reaches a handler (where a missing operand would shift every buffer after it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash import _ffi, _operands
from jax_flash._masks import KernelMasks


def test_the_mask_operands_are_in_the_order_of_kernel_masks():
    for operands in (_operands.FwdOperands, _operands.BwdOperands):
        fields = operands._fields
        start = fields.index("seqlens")
        end = start + len(KernelMasks._fields)
        assert fields[start:end] == KernelMasks._fields
        assert fields[end:end + 2] == ("bias", "mask")


def _decode_call():
    x = jnp.zeros((1, 1, 1, 64), jnp.bfloat16)
    empty = jnp.zeros((1, 0), jnp.int32)
    operands = _operands.DecodeOperands(x, x, x, kv_lengths=empty, page_table=empty, key_scale=empty, value_scale=empty,
                                        sinks=jnp.zeros((1, 0), jnp.float32))
    results = _operands.DecodeResults(*(jax.ShapeDtypeStruct(s, d) for s, d in [
        (x.shape, x.dtype), ((1, 1, 1), jnp.float32), ((0,), jnp.float32), ((0,), jnp.float32)]))  # fmt: skip
    attrs = {name: np.int32(0) for name in _operands.TARGETS["jax_flash_decode"][2]}
    return operands, results, attrs


def test_a_call_that_matches_the_table_passes():
    operands, results, attrs = _decode_call()
    assert _ffi.checked_attrs("jax_flash_decode", operands, results, attrs) is attrs


@pytest.mark.parametrize("change", ["plain tuple", "missing attribute", "extra attribute", "other target"])
def test_a_call_that_does_not_match_the_table_is_refused(change):
    operands, results, attrs = _decode_call()
    target = "jax_flash_decode"
    if change == "plain tuple":
        operands = tuple(operands)
    elif change == "missing attribute":
        attrs.pop("splits")
    elif change == "extra attribute":
        attrs["family"] = np.int32(90)
    else:
        target = "jax_flash_fwd"
    with pytest.raises(TypeError, match=target):
        _ffi.call_kernel(target, results, operands, attrs)
