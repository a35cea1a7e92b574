"""Kernel calls under sharding: split over batch and heads, so that sharded inputs are not gathered.

XLA cannot look inside a custom call: without a rule it gathers every sharded operand and runs the
whole call on each device. `over_batch_and_heads` runs a kernel call per device on its own batch
rows and heads, with no collective, because attention is independent across both:
  - over auto mesh axes through `custom_partitioning` (XLA's partitioner asks how to split it);
  - over explicit mesh axes (the sharding is in the traced types) through `shard_map`.
Every other axis (sequence, head dim) is kept whole: inputs sharded there are gathered along it
(`jax_flash.ring_attention` is for sequence sharding).

Each operand and result is described by a layout string, one letter per axis: "b" batch, "n"
query heads, "k" key/value heads, "-" any other axis (never split). The first operand must be the
queries ("b-n-"): their sharding decides the split. Results are sums over what their layouts
lack:
  - one with a "k" axis sums over the query heads of each kv head's group (dK, dV): where the
    query heads are split and the kv heads are not (MQA), each device has part of that sum;
  - one without "b" (or without "n" and "k") sums over the batch (the heads): the gradient of a
    bias broadcast over them.
Each device's parts are then added (an all-reduce).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

shard_map = getattr(jax, "shard_map", None)
if shard_map is None:  # older jax
    from jax.experimental.shard_map import shard_map


def varying_axes(x) -> frozenset:
    """The mesh axes `x` varies over inside shard_map (empty outside)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def _vary_over(x, axes):
    missing = tuple(sorted(frozenset(axes) - varying_axes(x)))
    if not missing:
        return x
    cast = getattr(jax.lax, "pcast", None)
    return cast(x, missing, to="varying") if cast is not None else jax.lax.pvary(x, missing)


def vary_like(results, *inputs) -> tuple:
    """`results` made varying over the mesh axes that `inputs` vary over. Inside `shard_map` an
    ffi_call's results carry no varying axes, and a gradient whose cotangents do not match its
    inputs' types is refused (a gradient of the kernels inside shard_map, ring attention)."""
    wanted = frozenset().union(*(varying_axes(x) for x in inputs))
    return tuple(_vary_over(r, wanted) for r in results)


def _axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _spec_axes(spec) -> set[str]:
    """Every mesh axis a PartitionSpec names."""
    return {a for entry in spec for a in _axes(entry)}


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _mesh_axes(mesh, query_spec, kv_heads: int) -> dict[str, tuple[str, ...]]:
    """The mesh axes of each layout letter, read from the queries' PartitionSpec.

    Heads are split only where the kv heads can follow: when the kv head count is a multiple of
    the head shards (each device keeps whole GQA groups), or with one kv head (MQA, which every
    device keeps whole). Otherwise the heads stay whole."""
    spec = tuple(query_spec) + (None,) * 4
    batch, heads = _axes(spec[0]), _axes(spec[2])
    head_shards = math.prod(mesh.shape[a] for a in heads)
    if heads and kv_heads % head_shards == 0:
        kv = heads
    elif heads and kv_heads == 1:
        kv = ()
    else:
        heads = kv = ()
    return {"b": batch, "n": heads, "k": kv}


def _spec(layout: str, axes: dict[str, tuple[str, ...]]) -> P:
    return P(*(_entry(axes.get(letter, ())) for letter in layout))


def _summed_axes(layout: str, axes) -> tuple[str, ...]:
    """The mesh axes over which a result's per-device parts are added (see the module docstring)."""
    summed = () if "b" in layout else axes["b"]
    if "k" in layout:
        return summed + tuple(a for a in axes["n"] if a not in axes["k"])
    return summed + (() if "n" in layout else axes["n"])


def _per_device(kernel: Callable, layouts_out: Sequence[str], axes) -> Callable:
    """The kernel on one device's operands, its partial results added up over the devices."""
    summed = [_summed_axes(layout, axes) for layout in layouts_out]
    if not any(summed):
        return kernel

    def run(*operands):
        results = kernel(*operands)
        return tuple(jax.lax.psum(r, s) if s and r.size else r for r, s in zip(results, summed))

    return run


def _sharding_rule(layouts_in: Sequence[str], layouts_out: Sequence[str], heads: int, kv_heads: int):
    """Shardy's rule: batch and heads are shared factors (query heads as kv heads times the GQA
    group; with one kv head, on their own), every other axis its own factor that must stay whole."""
    whole = []
    head_factor = "k" if heads == kv_heads else "n" if kv_heads == 1 else "(k g)"

    def factors(layout: str) -> str:
        names = []
        for letter in layout:
            if letter == "b":
                names.append("b")
            elif letter == "n":
                names.append(head_factor)
            elif letter == "k" and kv_heads > 1:
                names.append("k")
            else:
                whole.append(f"x{len(whole)}")
                names.append(whole[-1])
        return " ".join(names)

    operands = ", ".join(factors(layout) for layout in layouts_in)
    results = ", ".join(factors(layout) for layout in layouts_out)
    group = {"g": heads // kv_heads} if head_factor == "(k g)" else {}
    return f"{operands} -> {results}", dict(need_replication_factors=tuple(whole), **group)


def _over_auto_axes(kernel: Callable, layouts_in, layouts_out, heads: int, kv_heads: int) -> Callable:
    call = custom_partitioning(kernel)

    def plan(mesh, arg_shapes):
        sharding = arg_shapes[0].sharding
        spec = sharding.spec if isinstance(sharding, NamedSharding) else P()
        axes = _mesh_axes(mesh, spec, kv_heads)
        results = tuple(NamedSharding(mesh, _spec(layout, axes)) for layout in layouts_out)
        return axes, results, tuple(NamedSharding(mesh, _spec(layout, axes)) for layout in layouts_in)

    def partition(mesh, arg_shapes, result_shape):
        axes, results, operands = plan(mesh, arg_shapes)
        return mesh, _per_device(kernel, layouts_out, axes), results, operands

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
        return plan(mesh, arg_shapes)[1]

    rule, rule_options = _sharding_rule(layouts_in, layouts_out, heads, kv_heads)
    call.def_partition(partition, infer_sharding_from_operands=infer_sharding_from_operands,
                       sharding_rule=rule, **rule_options)  # fmt: skip
    return call


def explicit_sharding(x) -> NamedSharding | None:
    """The sharding in x's type when it is split over explicit mesh axes, else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_types", None):
        return None
    explicit = {a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit}
    return sharding if _spec_axes(sharding.spec) & explicit else None


def zeros_like(x, dtype) -> jax.Array:
    """Zeros of x's shape in `dtype`, split as x is over explicit mesh axes. Under jit with no
    mesh context, jax 0.12's `jnp.zeros_like` drops that split, and `dynamic_update_slice` then
    refuses to add a split update into the unsplit zeros."""
    zeros = jnp.zeros_like(x, dtype)
    sharding = explicit_sharding(x)
    if sharding is not None and jax.typeof(zeros).sharding.spec != sharding.spec:
        zeros = jax.sharding.reshard(zeros, sharding)
    return zeros


def _local_shape(shape, spec: P, mesh) -> tuple[int, ...]:
    return tuple(size // math.prod(mesh.shape[a] for a in _axes(entry)) for size, entry in zip(shape, spec))


def _over_explicit_axes(kernel: Callable, layouts_in, layouts_out, kv_heads: int, sharding, operands):
    mesh = sharding.mesh
    axes = _mesh_axes(mesh, sharding.spec, kv_heads)
    in_specs = tuple(_spec(layout, axes) for layout in layouts_in)
    out_specs = tuple(_spec(layout, axes) for layout in layouts_out)
    per_device = _per_device(kernel, layouts_out, axes)
    # Zero-size operands (absent masks) are made inside the body: as operands of the manual
    # computation they crashed XLA's GPU compiler (jaxlib 0.11.2, 2 H200s).
    passed = [i for i, x in enumerate(operands) if x.size]
    local_empty = {i: (_local_shape(x.shape, in_specs[i], mesh), x.dtype) for i, x in enumerate(operands) if not x.size}

    def body(*local_passed):
        local = dict(zip(passed, local_passed))
        local.update({i: jnp.zeros(shape, dtype) for i, (shape, dtype) in local_empty.items()})
        results = per_device(*(local[i] for i in range(len(operands))))
        return tuple(_vary_over(r, _spec_axes(spec)) for r, spec in zip(results, out_specs))

    resharded = [jax.sharding.reshard(operands[i], NamedSharding(mesh, in_specs[i])) for i in passed]
    in_passed = tuple(in_specs[i] for i in passed)
    return shard_map(body, mesh=mesh, in_specs=in_passed, out_specs=out_specs)(*resharded)


def over_batch_and_heads(kernel: Callable, layouts_in: Sequence[str], layouts_out: Sequence[str],
                         heads: int, kv_heads: int) -> Callable:  # fmt: skip
    """kernel(*operands) -> tuple of results, run per device on its batch rows and heads when the
    operands are sharded (as it is on one device or inside shard_map)."""
    over_auto = _over_auto_axes(kernel, layouts_in, layouts_out, heads, kv_heads)

    def call(*operands):
        sharding = explicit_sharding(operands[0])
        if sharding is None:
            return over_auto(*operands)
        return _over_explicit_axes(kernel, layouts_in, layouts_out, kv_heads, sharding, operands)

    return call
