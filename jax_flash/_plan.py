"""Which kernels run a call: the one place for the rules of kernel families and kernel head dims.

The Python layer decides once per call: the family (`family()`), the head dims the forward and
backward kernels run at (zero padding up to them), and whether the split-KV decode kernels take
the call. The family travels to the handlers as the custom calls' `family` attribute
(`Family`'s values, dispatch.h's `KernelFamily`), and cuda/launch/dispatch.cu launches that
family's kernel for the head dims it is given, or fails naming the plan it cannot run; within the
Hopper family it runs the mma.sync kernels where Hopper has none (head dims 32 and 96, decode) or
where a bias's layout is not in pairs (an operand's layout, read there).
"""

from __future__ import annotations

import dataclasses
import enum
import os

from jax_flash import _contract, _decode, _ffi


class Family(enum.IntEnum):
    """The kernel families, as the `family` attribute of the custom calls names them."""

    TURING = 75  # mma.sync m16n8k8, fp16 only, head dims 64-128, no bias (sm_75; forced elsewhere for tests)
    MMA_SYNC = 80  # mma.sync m16n8k16 (sm_80 and later)
    HOPPER = 90  # wgmma and TMA (sm_90a code on a 9.0 GPU), with the mma.sync kernels for the rest


# Which kernels a call may use (read when a call is traced): "best" (Hopper's on a 9.0 GPU with
# sm_90a code, Turing's on 7.x, the mma.sync ones elsewhere), "sm80" (the mma.sync kernels
# everywhere, so that they stay tested on Hopper) or "sm75" (the Turing kernels, which a test
# build also compiles for Hopper).
KERNELS_ENV = "JAX_FLASH_KERNELS"
FORCED_FAMILIES = {"best": None, "sm80": Family.MMA_SYNC, "sm75": Family.TURING}


def forced_family() -> Family | None:
    """The family JAX_FLASH_KERNELS forces, or None ("best", or unset)."""
    name = os.environ.get(KERNELS_ENV, "best")
    if name not in FORCED_FAMILIES:
        raise ValueError(f"{KERNELS_ENV} must be one of {sorted(FORCED_FAMILIES)}, got {name!r}")
    return FORCED_FAMILIES[name]


def family_of(capability: tuple[int, int], archs: tuple[str, ...]) -> Family:
    """The family a GPU of `capability` runs with a module built for `archs` (as forced)."""
    forced = forced_family()
    if forced is not None:
        return forced
    if capability[0] == 7:
        return Family.TURING
    if capability == (9, 0) and "90a" in archs:
        return Family.HOPPER
    return Family.MMA_SYNC


def family() -> Family:
    """The family the default GPU runs."""
    return family_of(_ffi.device_capability(), _ffi.built_archs())


def family_archs(of: Family) -> tuple[str, ...]:
    """The built targets a family was compiled for (CMakeLists.txt); forced to the mma.sync family,
    those of its files that Hopper GPUs otherwise leave to their own kernels."""
    if of is Family.TURING:
        return _ffi.family_archs()["turing"]
    if forced_family() is Family.MMA_SYNC:
        return _ffi.family_archs()["mma_sync_off_hopper"]
    return _ffi.built_archs()


def kernel_head_dim(head_dim: int, kernel_dims: tuple[int, ...] = _contract.FWD_HEAD_DIMS) -> int | None:
    """The smallest head dim with kernels (forward ones by default) that fits `head_dim` (zero
    padding), or None."""
    return next((d for d in kernel_dims if d >= head_dim), None)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """What runs one call on the kernels, decided once when it is traced (`kernel_plan`): the
    family; the forward kernel's (query/key, value) head dims, each side zero-padded up to them;
    whether the split-KV decode kernels take it instead; the backward kernels' head dims (None: no
    backward kernels, the xla path's backward) and whether they fit this GPU's shared memory."""

    family: Family
    forward_dims: tuple[int, int]
    decode: bool
    backward_dims: tuple[int, int] | None
    backward_fits: bool


def kernel_plan(of: Family, query_shape: tuple, kv_heads: int, value_dim: int, bias_or_2d_mask: bool,
                beyond_key_lengths: bool) -> KernelPlan:  # fmt: skip
    """The plan of a call of `query_shape` [B, T, N, H], `kv_heads` and `value_dim` that the kernels
    take; `bias_or_2d_mask`: a bias, or a mask that varies along both queries and keys;
    `beyond_key_lengths`: any mask but key lengths (the decode kernels take key lengths alone)."""
    forward = forward_head_dims(of, query_shape, kv_heads, value_dim, bias_or_2d_mask, beyond_key_lengths)
    decode = runs_decode(of, tuple(query_shape[:3]) + (forward[0],), kv_heads, forward[1], beyond_key_lengths)
    return KernelPlan(of, forward, decode, *backward_plan(of, *forward, bias_or_2d_mask))


def backward_plan(of: Family, head_dim: int, value_dim: int, bias_or_mask: bool) -> tuple[tuple[int, int] | None, bool]:
    """(the backward kernels' head dims or None, whether they fit) for a forward kernel's head dims."""
    dims = backward_head_dims(of, head_dim, value_dim, bias_or_mask)
    return dims, dims is not None and backward_kernels_fit(of, dims[0])


def forward_head_dims(of: Family, query_shape: tuple, kv_heads: int, value_dim: int, bias_or_2d_mask: bool,
                      beyond_key_lengths: bool) -> tuple[int, int]:  # fmt: skip
    """The (query/key, value) head dims of the forward kernel for a call of `query_shape` [B, T, N,
    H] and `value_dim`, each side zero-padded up to them: a pair with a kernel of its own (Hopper's,
    FWD_SM90_UNEQUAL_HEAD_DIMS) where V is narrower, there is no bias or 2-d mask and the call is
    not one for the decode kernels (which, at the wider dim, read the cache faster); else the
    widest's for both."""
    head_dim = query_shape[-1]
    widest = max(head_dim, value_dim)
    if of is Family.TURING:
        padded = kernel_head_dim(widest, _contract.FWD_SM75_HEAD_DIMS)
        return padded, padded
    padded = kernel_head_dim(widest, _contract.FWD_HEAD_DIMS + _contract.FWD_SM90_WIDE_HEAD_DIMS)
    if value_dim < head_dim and of is Family.HOPPER and not bias_or_2d_mask:
        decode = runs_decode(of, tuple(query_shape[:3]) + (padded,), kv_heads, padded, beyond_key_lengths)
        pair = (kernel_head_dim(head_dim), kernel_head_dim(value_dim))
        if not decode and pair in _contract.FWD_SM90_UNEQUAL_HEAD_DIMS:
            return pair
    return padded, padded


def backward_head_dims(of: Family, head_dim: int, value_dim: int, bias_or_mask: bool) -> tuple[int, int] | None:
    """The (query/key, value) head dims of the backward kernels that differentiate a forward
    kernel's `head_dim` and `value_dim` (value_dim <= head_dim), each zero-padded up to them, or
    None above them. The Hopper family without a bias or 2-d mask also has 192 and the pairs of
    BWD_SM90_UNEQUAL_HEAD_DIMS; elsewhere 192 takes 256, V padded to the same."""
    if of is Family.TURING:
        padded = kernel_head_dim(head_dim, _contract.BWD_SM75_HEAD_DIMS)
        return None if padded is None else (padded, padded)
    hopper = of is Family.HOPPER and not bias_or_mask
    dims = _contract.BWD_HEAD_DIMS
    if hopper:
        dims = tuple(sorted(dims + _contract.BWD_SM90_NO_BIAS_HEAD_DIMS))
    padded = kernel_head_dim(head_dim, dims)
    if padded is None:
        return None
    pair = (padded, kernel_head_dim(value_dim, _contract.BWD_HEAD_DIMS))
    return pair if hopper and pair in _contract.BWD_SM90_UNEQUAL_HEAD_DIMS else (padded, padded)


def runs_decode(of: Family, query_shape: tuple, kv_heads: int, value_dim: int, beyond_key_lengths: bool) -> bool:
    """Whether a call of these (padded) shapes runs on the split-KV decode kernels: not the Turing
    family (mma.sync m16n8k16), equal head dims with decode kernels, and a shape and masks that
    `_decode.takes`."""
    b, t, n, h = query_shape
    if of is Family.TURING:
        return False
    decode_dims = h in _contract.DECODE_HEAD_DIMS and value_dim == h
    return decode_dims and _decode.takes(b, t, n, kv_heads, masks_beyond_key_lengths=beyond_key_lengths)


def backward_kernels_fit(of: Family, head_dim: int) -> bool:
    """Whether the backward kernels of a (kernel) head dim fit the default GPU's shared memory:
    Hopper's own always (227 KB a block); the mma.sync ones where their smallest tiles' bytes a
    block (the compact ones, cuda/sm80/config.cuh) are within `_ffi.smem_limit()` (their launcher
    takes the largest tiles that fit); the Turing ones likewise."""
    if of is Family.TURING:
        return _ffi.extension().sm75_backward_smem_bytes(head_dim) <= _ffi.smem_limit()
    hopper_dims = _contract.BWD_SM90_HEAD_DIMS + _contract.BWD_SM90_NO_BIAS_HEAD_DIMS
    if of is Family.HOPPER and head_dim in hopper_dims:
        return True
    return _ffi.extension().sm80_backward_smem_bytes(head_dim) <= _ffi.smem_limit()
