"""Which kernels run a call: the one place for the rules of kernel families, kernel head dims and
the tiles that depend on the call.

The Python layer decides once per call: the family (`family()`), the head dims the forward and
backward kernels run at (zero padding up to them), whether the split-KV decode kernels take the
call, and the tiles of the forward and backward kernels (`forward_tiles`, `backward_tiles`). The
family and tiles travel to the handlers as the custom calls' `family` and `tiles` attributes
(`Family`'s and `Tiles`' values: dispatch.h's `KernelFamily`, contract.h's `Tiles`), and
cuda/launch/dispatch.cu launches that family's kernel with those tiles for the head dims it is
given, or fails naming the plan it cannot run. Two choices stay with the launchers, as they read
what a plan cannot see (operand strides and pointer alignment): within the Hopper family a bias
or mask whose layout is not in pairs runs the mma.sync kernels, and the Hopper kernels stage a
bias by TMA where its rows copy as whole aligned rows. The decode launcher's residency (one CTA
an SM, from the grid and the GPU's SM count) is its own too.
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


# The launchers' tile shapes that depend on the call (contract.h's Tiles, from the generator's table).
Tiles = enum.IntEnum("Tiles", _contract.TILES)


@dataclasses.dataclass(frozen=True)
class TileTraits:
    """What the tile rules read of a call, once a padding mask runs as segment ids: the kernels'
    variant (a bias or mask, else a soft cap, else lengths or segment ids), the window (None:
    unbounded on that side; causal is window_right = 0) and deterministic mode."""

    bias_or_mask: bool = False
    softcap: bool = False
    lengths: bool = False
    segments: bool = False
    window_left: int | None = None
    window_right: int | None = None
    deterministic: bool = False

    @property
    def plain(self) -> bool:
        return not (self.bias_or_mask or self.softcap or self.lengths or self.segments)

    @property
    def banded(self) -> bool:
        return self.window_left is not None or self.window_right is not None


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """What runs one call on the kernels, decided once when it is traced (`kernel_plan`): the
    family; the forward kernel's (query/key, value) head dims, each side zero-padded up to them;
    whether the split-KV decode kernels take it instead; the backward kernels' head dims (None: no
    backward kernels, the xla path's backward) and whether they fit this GPU's shared memory; the
    forward and backward kernels' tiles."""

    family: Family
    forward_dims: tuple[int, int]
    decode: bool
    backward_dims: tuple[int, int] | None
    backward_fits: bool
    forward_tiles: Tiles = Tiles.USUAL
    backward_tiles: Tiles = Tiles.USUAL


def kernel_plan(of: Family, query_shape: tuple, kv_heads: int, value_dim: int, bias_or_2d_mask: bool,
                beyond_key_lengths: bool, traits: TileTraits) -> KernelPlan:  # fmt: skip
    """The plan of a call of `query_shape` [B, T, N, H], `kv_heads` and `value_dim` that the kernels
    take; `bias_or_2d_mask`: a bias, or a mask that varies along both queries and keys;
    `beyond_key_lengths`: any mask but key lengths (the decode kernels take key lengths alone);
    `traits`: what the tile rules read."""
    forward, decode = forward_plan(of, query_shape, kv_heads, value_dim, bias_or_2d_mask, beyond_key_lengths)
    backward = backward_plan(of, *forward, bias_or_2d_mask)
    tiles = Tiles.USUAL if decode else forward_tiles(of, forward, query_shape[1], traits)
    return KernelPlan(of, forward, decode, *backward, tiles, backward_tiles(of, backward[0], traits))


def backward_plan(of: Family, head_dim: int, value_dim: int, bias_or_mask: bool) -> tuple[tuple[int, int] | None, bool]:
    """(the backward kernels' head dims or None, whether they fit) for a forward kernel's head dims."""
    dims = backward_head_dims(of, head_dim, value_dim, bias_or_mask)
    return dims, dims is not None and backward_kernels_fit(of, dims[0])


def forward_plan(of: Family, query_shape: tuple, kv_heads: int, value_dim: int, bias_or_2d_mask: bool,
                 beyond_key_lengths: bool) -> tuple[tuple[int, int], bool]:  # fmt: skip
    """((query/key, value) head dims of the forward kernel, whether the decode kernels run it) for a
    call of `query_shape` [B, T, N, H] and `value_dim`, each side zero-padded up to the dims: the
    widest's for both, except a pair with a kernel of its own (Hopper's, FWD_SM90_UNEQUAL_HEAD_DIMS)
    where V is narrower, there is no bias or 2-d mask and the call is not one for the decode
    kernels (which, at the wider dim, read the cache faster)."""
    head_dim = query_shape[-1]
    widest = max(head_dim, value_dim)
    if of is Family.TURING:
        padded = kernel_head_dim(widest, _contract.FWD_SM75_HEAD_DIMS)
        return (padded, padded), False
    padded = kernel_head_dim(widest, _contract.FWD_HEAD_DIMS + _contract.FWD_SM90_WIDE_HEAD_DIMS)
    decode = runs_decode(of, tuple(query_shape[:3]) + (padded,), kv_heads, padded, beyond_key_lengths)
    if value_dim < head_dim and of is Family.HOPPER and not bias_or_2d_mask and not decode:
        pair = (kernel_head_dim(head_dim), kernel_head_dim(value_dim))
        if pair in _contract.FWD_SM90_UNEQUAL_HEAD_DIMS:
            return pair, False
    return (padded, padded), decode


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
    block (the compact ones, cuda/sm80/config.cuh) are within `_ffi.smem_limit()` (`backward_tiles`
    takes the usual ones where those fit); the Turing ones likewise."""
    if of is Family.TURING:
        return _ffi.extension().sm75_backward_smem_bytes(head_dim) <= _ffi.smem_limit()
    hopper_dims = _contract.BWD_SM90_HEAD_DIMS + _contract.BWD_SM90_NO_BIAS_HEAD_DIMS
    if of is Family.HOPPER and head_dim in hopper_dims:
        return True
    return _ffi.extension().sm80_backward_smem_bytes(head_dim) <= _ffi.smem_limit()


def forward_tiles(of: Family, dims: tuple[int, int], seqlen_q: int, traits: TileTraits) -> Tiles:
    """The forward kernel's tiles: USUAL but for the Hopper kernels at equal head dims of
    FWD_SM90_HEAD_DIMS (docs/perf/log.md's steps in brackets):
    - 64, plain or with lengths: TALL (192 query rows) without a band [H5], and for causal rows
      from 8k on [H12]; not for a window (128-row tiles waste less on the diagonal), segment ids
      (whose documents' edges 192-row tiles straddle) [H24], or the soft cap (its tanh made the
      consumers spill);
    - 128 and 256 without a bias or mask: WIDE_KEYS [H9-H11]; at 128 not with a window bounded on
      the left or segment ids, which waste more of 176 keys at their edges [H11] (256's blocks are
      80 keys against 64 and lose nothing). A bias keeps the narrow blocks: with the wide ones its
      loads' registers spilled."""
    head_dim, value_dim = dims
    if of is not Family.HOPPER or head_dim != value_dim or head_dim not in _contract.FWD_SM90_HEAD_DIMS:
        return Tiles.USUAL
    if head_dim == 64 and not (traits.bias_or_mask or traits.softcap or traits.segments):
        long_causal = traits.window_left is None and seqlen_q >= 8192
        if not traits.banded or long_causal:
            return Tiles.TALL
    if head_dim in (128, 256) and not traits.bias_or_mask:
        edges = traits.window_left is not None or traits.segments
        if head_dim == 256 or not edges:
            return Tiles.WIDE_KEYS
    return Tiles.USUAL


def backward_tiles(of: Family, dims: tuple[int, int] | None, traits: TileTraits) -> Tiles:
    """The backward kernels' tiles: on the Hopper kernels at head dim 128, STEPS_OF_80 (80-query
    steps, FlashAttention-3's non-causal tile) for a plain call without a band or deterministic
    mode (whose turns count 64-row blocks); on the mma.sync kernels COMPACT where their usual tiles
    exceed the shared memory a block may take (`_ffi.smem_limit()`: sm_86, sm_89 and sm_12x allow
    99 KB); else USUAL. (A Hopper call whose bias layout sends it to the mma.sync kernels keeps
    USUAL, which fits Hopper's 227 KB.)"""
    if dims is None or of is Family.TURING:
        return Tiles.USUAL
    head_dim, value_dim = dims
    hopper_dims = _contract.BWD_SM90_HEAD_DIMS + _contract.BWD_SM90_NO_BIAS_HEAD_DIMS
    if of is Family.HOPPER and (head_dim in hopper_dims or head_dim != value_dim):
        if head_dim == value_dim == 128 and traits.plain and not traits.banded and not traits.deterministic:
            return Tiles.STEPS_OF_80
        return Tiles.USUAL
    if _ffi.extension().sm80_backward_usual_smem_bytes(head_dim) > _ffi.smem_limit():
        return Tiles.COMPACT
    return Tiles.USUAL
