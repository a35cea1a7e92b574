"""Forward-mode AD for attention whose reverse mode is a hand-written backward.

JAX gives a function either a custom_vjp (no `jax.jvp`) or a custom_jvp (reverse mode by
transposing the tangent's operations, not by our backward). `TangentMap` gives both: the attention
is a custom_jvp whose tangent is one primitive, linear in the tangents, that JAX evaluates with a
forward-mode formula under `jax.jvp` and transposes with the backward under `jax.grad` (same
residuals, same cost and rounding as a custom_vjp).

Operands of the primitive, in order: the call's arrays (`primals`; those of a layout's `None`s
left out), the forward's output and log-sum-exp, and the tangents of the differentiable inputs.
Every operand's leading axis is the batch axis, of the call's batch size or 1 (a broadcast bias),
which is how the batching rule folds a vmapped axis into it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir


class Layout(NamedTuple):
    """Which of the call's arrays are present (static), and which of them have tangents."""

    primals: tuple[bool, ...]  # per primal argument: not None
    differentiable: tuple[int, ...]  # indices of the primal arguments that take tangents


def unflatten(layout: Layout, operands) -> tuple[tuple, jax.Array, jax.Array, tuple]:
    """(primals with their Nones, out, lse, tangents in `differentiable` order)."""
    it = iter(operands)
    primals = tuple(next(it) if present else None for present in layout.primals)
    out, lse = next(it), next(it)
    return primals, out, lse, tuple(it)


def flatten(layout: Layout, primals, out, lse, tangents) -> list:
    return [x for x in primals if x is not None] + [out, lse] + list(tangents)


def layout_of(primals, differentiable: tuple[int, ...]) -> Layout:
    present = tuple(x is not None for x in primals)
    return Layout(present, tuple(i for i in differentiable if present[i]))


class TangentMap:
    """The primitive `name`: `tangent(static, primals, out, lse, tangents) -> (d_out, d_lse)`
    evaluates it; `transpose(static, primals, out, lse, d_out, d_lse, needed)` gives the
    cotangents of the tangents (the gradients of the differentiable inputs, in `differentiable`
    order; `needed` says which of them the caller differentiates). With `symbolic_zeros`, an
    output the loss does not use passes a cotangent of None, else zeros.
    `differentiable_tangent` (default `tangent`) is the formula that second-order derivatives
    differentiate: one that reverse mode can go through."""

    def __init__(self, name: str, tangent: Callable, transpose: Callable,
                 differentiable_tangent: Callable | None = None, symbolic_zeros: bool = False):  # fmt: skip
        self._tangent, self._transpose = tangent, transpose
        self._differentiable_tangent = differentiable_tangent or tangent
        self._symbolic_zeros = symbolic_zeros
        self.primitive = p = Primitive(name)
        p.multiple_results = True
        p.def_impl(self._impl)
        p.def_abstract_eval(self._abstract_eval)
        mlir.register_lowering(p, mlir.lower_fun(self._impl, multiple_results=True))
        ad.primitive_transposes[p] = self._transpose_rule
        ad.primitive_jvps[p] = self._jvp_rule
        batching.primitive_batchers[p] = self._batching_rule

    def __call__(self, static, layout: Layout, primals, out, lse, tangents):
        return self.primitive.bind(*flatten(layout, primals, out, lse, tangents), static=static, layout=layout)

    def _impl(self, *operands, static, layout):
        primals, out, lse, tangents = unflatten(layout, operands)
        return list(self._tangent(static, primals, out, lse, tangents))

    @staticmethod
    def _abstract_eval(*avals, static, layout):
        _, out, lse, _ = unflatten(layout, avals)
        # The tangents of out and lse are shaped (and sharded) as they are; they vary over the
        # manual mesh axes (shard_map) of every operand.
        vma = frozenset().union(*(getattr(a, "vma", frozenset()) for a in avals))
        return [a.update(vma=vma) if hasattr(a, "vma") else a for a in (out, lse)]

    def _transpose_rule(self, cotangents, *operands, static, layout):
        primals, out, lse, tangents = unflatten(layout, operands)
        if any(ad.is_undefined_primal(x) for x in (*primals, out, lse)):
            raise ValueError("the attention's tangent is linear in the tangents alone")  # JAX never asks
        if self._symbolic_zeros:
            d_out, d_lse = (None if type(ct) is ad.Zero else ct for ct in cotangents)
        else:
            d_out, d_lse = (ad.instantiate_zeros(ct) for ct in cotangents)
        needed = tuple(ad.is_undefined_primal(t) for t in tangents)
        grads = self._transpose(static, primals, out, lse, d_out, d_lse, needed)
        return [None] * (len(operands) - len(tangents)) + [g if n else None for g, n in zip(grads, needed)]

    def _jvp_rule(self, operands, tangents, *, static, layout):
        # Second order (a jvp or grad of this tangent): the formula's own derivative.
        def f(*ops):
            primals, out, lse, tangents = unflatten(layout, ops)
            return list(self._differentiable_tangent(static, primals, out, lse, tangents))

        return jax.jvp(f, tuple(operands), tuple(ad.instantiate_zeros(t) for t in tangents))

    def _batching_rule(self, operands, dims, *, static, layout):
        # One call over batch x the vmapped axis: each operand's vmapped axis moved to the front,
        # broadcast where absent, and merged into its batch axis (broadcast to the batch first).
        size = next(x.shape[d] for x, d in zip(operands, dims) if d is not None)
        batch = operands[0].shape[1 if dims[0] == 0 else 0]  # the query's batch axis
        merged = []
        for x, d in zip(operands, dims):
            x = jnp.broadcast_to(x, (size,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)
            x = jnp.broadcast_to(x, (size, batch) + x.shape[2:])
            merged.append(x.reshape((size * batch,) + x.shape[2:]))
        outs = self.primitive.bind(*merged, static=static, layout=layout)
        return [o.reshape((size, batch) + o.shape[1:]) for o in outs], [0, 0]
