"""The CUDA path's Python, on CPU: with a pure-JAX stand-in for the two custom calls
(tests/fake_kernels.py), `implementation="cuda"` runs its real plumbing (head-dim padding, the mask
operands and their chunk summaries, the custom_jvp and its transpose, vmap folding, partitioning) and must give what
the xla path gives. What the kernels compute is tested on GPUs (test_cuda*.py)."""

import types

import jax
import jax.numpy as jnp
import pytest
from jaxlib import xla_client

import jax_flash
from jax_flash import _contract, _decode, _ffi, _operands, _plan, dense_impl
from tests import fake_kernels, reference
from tests.cases import CASES, qkv, rng_for

KERNEL_CASES = ["none", "causal", "window_causal", "lengths_causal", "segments_causal", "softcap", "bias",
                "bias_broadcast", "mask", "softcap_bias_window", "everything"]


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = fake_kernels.record_calls(monkeypatch)
    # Short query lengths here test the forward kernels' plumbing; the decode kernels' has its
    # own tests (test_decode.py).
    monkeypatch.setenv(_decode.DECODE_ENV, "0")
    # The stand-in computes with the blockwise xla path: "xla" here is that path too, so that the
    # two differ only in the plumbing (a bias constant along the keys has a zero gradient, which
    # the dense path computes as 1e-7 and the blockwise one as its rounding, 1e-2 of the rows').
    monkeypatch.setattr(dense_impl, "budget_bytes", lambda: -1)
    return calls


def _loss(implementation, kw):
    """A loss of q, k, v and (when given, as a fourth argument) the bias."""
    kw = dict(kw)
    kw.pop("bias", None)

    def loss(q, k, v, bias=None):
        out = jax_flash.attention(q, k, v, bias, implementation=implementation, **kw)
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size).reshape(out.shape)))

    return loss


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_forward_and_gradients_equal_the_xla_path(kernel_calls, case):
    rng = rng_for("cuda-path-on-cpu", case)
    b, t, s, n, kv_heads, h = 3, 40, 56, 4, 2, 40  # head dim 40: padded to the kernels' 64
    q, k, v = qkv(rng, jnp.bfloat16, b, t, s, n, kv_heads, h)
    kw = CASES[case](rng, b, n, t, s)
    out, lse = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, implementation="cuda", return_residual=True,
                                                           **kw))(q, k, v)  # fmt: skip
    ref_out, ref_lse = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, implementation="xla",
                                                                   return_residual=True, **kw))(q, k, v)  # fmt: skip
    assert out.shape == q.shape and out.dtype == q.dtype
    assert reference.rel_error(out, ref_out) < 1e-2
    assert jnp.array_equal(jnp.isneginf(lse), jnp.isneginf(ref_lse))
    visible = ~jnp.isneginf(ref_lse)
    assert float(jnp.max(jnp.abs(jnp.where(visible, lse - ref_lse, 0.0)))) < 1e-3
    args = (q, k, v) + ((kw["bias"],) if "bias" in kw else ())
    argnums = tuple(range(len(args)))
    grads = jax.jit(jax.grad(_loss("cuda", kw), argnums))(*args)
    for mine, ref in zip(grads, jax.jit(jax.grad(_loss("xla", kw), argnums))(*args), strict=True):
        assert mine.shape == ref.shape and mine.dtype == ref.dtype
        assert reference.rel_error(mine, ref) < 2e-2
    targets = [target for target, _ in kernel_calls]
    assert targets.count("jax_flash_fwd") >= 2 and targets.count("jax_flash_bwd") == 1
    assert all(shapes[0][-1] == 64 for _, shapes in kernel_calls)  # padded head dim


def test_lse_cotangent_reaches_the_kernels_only_when_used(kernel_calls):
    """A loss of the output alone passes the backward an empty [B, N, 0] lse cotangent (read as
    zero: no zeros written); a loss of the lse too passes it whole, and both match the xla path."""
    q, k, v = qkv(rng_for("cuda-path-dlse"), jnp.bfloat16, 2, 24, 24, 2, 1, 32)

    def loss(implementation, use_lse):
        def f(q, k, v):
            out, lse = jax_flash.attention(q, k, v, is_causal=True, implementation=implementation,
                                           return_residual=True)
            return jnp.sum(out.astype(jnp.float32) ** 2) + (jnp.sum(jnp.sin(lse)) if use_lse else 0.0)
        return f

    for use_lse, lse_cotangent in ((False, (2, 2, 0)), (True, (2, 2, 24))):
        kernel_calls.clear()
        grads = jax.grad(loss("cuda", use_lse), argnums=(0, 1, 2))(q, k, v)
        for mine, ref in zip(grads, jax.grad(loss("xla", use_lse), argnums=(0, 1, 2))(q, k, v), strict=True):
            assert reference.rel_error(mine, ref) < 2e-2
        (shapes,) = [shapes for target, shapes in kernel_calls if target == "jax_flash_bwd"]
        assert shapes[6] == lse_cotangent


@pytest.mark.parametrize("case,backward_dim", [("hopper", 192), ("sm80 kernels", 256), ("bias", 256)])
def test_head_dim_without_kernels_pads_up(kernel_calls, monkeypatch, case, backward_dim):
    """Head dim 160: the forward runs the 192 kernels, and so does the backward on the Hopper
    kernels without a bias; with one, or on the mma.sync kernels (no 192 backward), the 256 ones."""
    rng = rng_for("cuda-path-160", case)
    q, k, v = qkv(rng, jnp.bfloat16, 2, 24, 24, 2, 1, 160)
    kw = {"is_causal": True}
    if case == "bias":
        kw["bias"] = jnp.asarray(rng.normal(size=(1, 2, 24, 24)), jnp.float32)
    if case == "sm80 kernels":
        monkeypatch.setenv(_plan.KERNELS_ENV, "sm80")
    args = (q, k, v, kw["bias"]) if "bias" in kw else (q, k, v)
    grads = jax.grad(_loss("cuda", kw), argnums=(0, 1, 2))(*args)
    for mine, ref in zip(grads, jax.grad(_loss("xla", kw), argnums=(0, 1, 2))(*args), strict=True):
        assert mine.shape == ref.shape and reference.rel_error(mine, ref) < 2e-2
    head_dims = {target: shapes[0][-1] for target, shapes in kernel_calls}
    assert head_dims == {"jax_flash_fwd": 192, "jax_flash_bwd": backward_dim}


def test_vmap_is_one_kernel_call(kernel_calls):
    """vmap over every input folds into the batch; over the queries alone, into the heads."""
    q, k, v = qkv(rng_for("cuda-path-vmap"), jnp.bfloat16, 6, 24, 24, 2, 1, 32)
    stacked = [x.reshape(3, 2, *x.shape[1:]) for x in (q, k, v)]
    attn = lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True, implementation="cuda")  # noqa: E731
    ref = jax_flash.attention(q, k, v, is_causal=True, implementation="xla")
    assert reference.rel_error(jax.vmap(attn)(*stacked).reshape(q.shape), ref) < 1e-2
    # custom_vmap traces the call once unbatched for its types; the call that runs is the last.
    assert kernel_calls[-1][1][:3] == [(6, 24, 2, 32), (6, 24, 1, 32), (6, 24, 1, 32)]
    kernel_calls.clear()
    queries = q.reshape(3, 2, 24, 2, 32)
    out = jax.vmap(attn, in_axes=(0, None, None))(queries, k[:2], v[:2])
    for i in range(3):
        expected = jax_flash.attention(queries[i], k[:2], v[:2], is_causal=True, implementation="xla")
        assert reference.rel_error(out[i], expected) < 1e-2
    assert kernel_calls[-1][1][:3] == [(2, 24, 6, 32), (2, 24, 1, 32), (2, 24, 1, 32)]  # heads n * V


def test_vmap_of_the_gradient_without_a_bias(kernel_calls):
    """The backward's empty dbias result ([B, 0, 0, 0]) unfolds from the batch like the others."""
    q, k, v = qkv(rng_for("cuda-path-vmap-grad"), jnp.bfloat16, 6, 24, 24, 2, 1, 32)
    stacked = [x.reshape(3, 2, *x.shape[1:]) for x in (q, k, v)]
    grad = lambda impl: jax.vmap(jax.grad(_loss(impl, {"is_causal": True}), argnums=(0, 1, 2)))  # noqa: E731
    for mine, ref in zip(grad("cuda")(*stacked), grad("xla")(*stacked), strict=True):
        assert mine.shape == ref.shape and reference.rel_error(mine, ref) < 2e-2
    assert kernel_calls[-1][0] == "jax_flash_bwd" and kernel_calls[-1][1][0] == (6, 24, 2, 32)  # folded


@pytest.mark.parametrize("case", ["causal", "bias", "everything"])
def test_forward_mode_runs_the_forward_kernel_and_the_xla_tangent(kernel_calls, case):
    """Auto mode: jax.jvp and jax.jacfwd run the forward kernel for the primal and the xla path's
    formula for the tangent (no kernel computes one), as the xla path's own jvp gives; reverse
    mode still transposes into the backward kernel."""
    rng = rng_for("cuda-path-jvp", case)
    b, t, s, n, kv_heads, h = 2, 24, 40, 4, 2, 40
    q, k, v = qkv(rng, jnp.float32, b, t, s, n, kv_heads, h)
    kw = CASES[case](rng, b, n, t, s)
    bias = kw.pop("bias", None)
    primals = (q, k, v) if bias is None else (q, k, v, bias)
    tangents = tuple(jnp.asarray(rng.normal(size=x.shape), x.dtype) for x in primals)
    primals, tangents = (tuple(x.astype(jnp.bfloat16) for x in xs) for xs in (primals, tangents))

    def f(implementation):
        return lambda *a: jax_flash.attention(*a[:3], bias=a[3] if len(a) > 3 else None,
                                              implementation=implementation, **kw)  # fmt: skip

    out, d_out = jax.jit(lambda p, t: jax.jvp(f(None), p, t))(primals, tangents)
    ref_out, ref_d_out = jax.jit(lambda p, t: jax.jvp(f("xla"), p, t))(primals, tangents)
    assert d_out.dtype == jnp.bfloat16
    assert reference.rel_error(out, ref_out) < 1e-2 and reference.rel_error(d_out, ref_d_out) < 2e-2
    assert [target for target, _ in kernel_calls] == ["jax_flash_fwd"]
    kernel_calls.clear()
    jax.grad(lambda q: f(None)(q, *primals[1:]).astype(jnp.float32).sum())(primals[0])
    assert [target for target, _ in kernel_calls] == ["jax_flash_fwd", "jax_flash_bwd"]


def test_forward_mode_under_implementation_cuda_says_what_to_use(kernel_calls):
    q, k, v = qkv(rng_for("cuda-path-jvp-strict"), jnp.bfloat16, 2, 24, 24, 2, 1, 32)
    f = lambda q: jax_flash.attention(q, k, v, is_causal=True, implementation="cuda")  # noqa: E731
    with pytest.raises(ValueError, match="implementation='cuda' has no forward-mode kernels.*implementation=None"):
        jax.jvp(f, (q,), (q,))
    jax.grad(lambda q: f(q).astype(jnp.float32).sum())(q)  # reverse mode: the kernels' backward
    assert [target for target, _ in kernel_calls][-2:] == ["jax_flash_fwd", "jax_flash_bwd"]


def test_auto_mode_takes_the_kernels_where_they_run(kernel_calls):
    q, k, v = qkv(rng_for("cuda-path-auto"), jnp.bfloat16, 2, 16, 16, 2, 2, 64)
    jax_flash.attention(q, k, v, is_causal=True, softcap=20.0)
    assert [target for target, _ in kernel_calls] == ["jax_flash_fwd"]
    kernel_calls.clear()
    jax_flash.attention(q, k, v, bias=jnp.zeros((1, 2, 16, 16), jnp.float32), mask=jnp.ones((2, 2, 16, 1), bool))
    assert [target for target, _ in kernel_calls] == ["jax_flash_fwd"]
    assert kernel_calls[0][1][-3:-1] == [(1, 2, 16, 16), (2, 2, 16, 1)]  # passed as given, not broadcast (then the sinks)
    kernel_calls.clear()
    jax_flash.attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))  # float32
    assert kernel_calls == []


@pytest.mark.parametrize("mask_shape", [(3, 1, 1, 56), (1, 1, 1, 56), (3, 1, 40, 1), (3, 1, 1, 1), (3, 1, 40, 56)])
def test_key_or_query_masks_reach_the_kernels_as_segment_ids(kernel_calls, mask_shape):
    """A mask along the keys alone (padding) or the queries alone runs as segment ids, with no
    mask operand; other masks stay masks. Values and gradients as the xla path's, with a batch
    row that sees no key (batch row 0)."""
    rng = rng_for("cuda-path-mask-segments", mask_shape)
    b, t, s, n = 3, 40, 56, 4
    q, k, v = qkv(rng, jnp.bfloat16, b, t, s, n, 2, 32)
    mask = rng.random(mask_shape) < 0.7
    mask[..., 0] = True  # every batch row sees a key ...
    if mask_shape[0] == b:
        mask[0] = False  # ... except row 0
    kw = dict(mask=jnp.asarray(mask), is_causal=mask_shape[2] == 1)
    out = jax_flash.attention(q, k, v, implementation="cuda", **kw)
    assert reference.rel_error(out, jax_flash.attention(q, k, v, implementation="xla", **kw)) < 1e-2
    if mask_shape[0] == b:
        assert (out[0] == 0).all()
    grads = jax.grad(_loss("cuda", kw), argnums=(0, 1, 2))(q, k, v)
    for mine, ref in zip(grads, jax.grad(_loss("xla", kw), argnums=(0, 1, 2))(q, k, v), strict=True):
        assert jnp.isfinite(mine).all() and reference.rel_error(mine, ref) < 2e-2
    as_segments = mask_shape[2] == 1 or mask_shape[3] == 1
    for target in ("jax_flash_fwd", "jax_flash_bwd"):
        shapes = dict(zip(_operands.TARGETS[target][0]._fields, [s for name, s in kernel_calls if name == target][-1]))
        segments, mask_operand = [shapes["q_segments"], shapes["kv_segments"]], shapes["mask"]
        assert segments == ([(b, t), (b, s)] if as_segments else [(b, 0), (b, 0)]), target
        assert mask_operand == ((b, 0, 0, 0) if as_segments else mask_shape), target


def test_bias_gradient_only_when_differentiated(kernel_calls):
    """The backward asks the kernels for dbias (in the bias's shape, float32) only when the bias
    is differentiated; a float64 bias is passed as float32 and its gradient comes back float64."""
    q, k, v = qkv(rng_for("cuda-path-dbias"), jnp.bfloat16, 2, 24, 24, 2, 2, 32)
    bias = jnp.asarray(rng_for("cuda-path-dbias-b").normal(size=(1, 2, 24, 1)))
    jax.grad(_loss("cuda", {}), argnums=(0, 1, 2))(q, k, v, bias)
    assert kernel_calls.results["jax_flash_bwd"][-1] == (2, 0, 0, 0)
    grads = jax.grad(_loss("cuda", {}), argnums=3)(q, k, v, bias)
    assert kernel_calls.results["jax_flash_bwd"][-1] == (1, 2, 24, 1)
    assert grads.dtype == bias.dtype
    assert reference.rel_error(grads, jax.grad(_loss("xla", {}), argnums=3)(q, k, v, bias)) < 2e-2


def test_deterministic_bias_gradient_is_summed_by_xla(kernel_calls, monkeypatch):
    """Deterministic mode: the kernels write every [B, N, T, S] element of dbias once, and XLA sums
    the broadcast axes (atomics would add them in any order)."""
    monkeypatch.setenv(_ffi.DETERMINISTIC_ENV, "1")
    q, k, v = qkv(rng_for("cuda-path-dbias-det"), jnp.bfloat16, 2, 24, 40, 4, 2, 32)
    bias = jnp.asarray(rng_for("cuda-path-dbias-det-b").normal(size=(1, 1, 24, 40)), jnp.float32)
    grads = jax.grad(_loss("cuda", {"is_causal": True}), argnums=3)(q, k, v, bias)
    assert kernel_calls.results["jax_flash_bwd"][-1] == (2, 4, 24, 40)
    assert grads.shape == bias.shape
    assert reference.rel_error(grads, jax.grad(_loss("xla", {"is_causal": True}), argnums=3)(q, k, v, bias)) < 2e-2


@pytest.mark.parametrize("bias_axes", [(0,), (0, 3), None], ids=["bias-mapped", "all-mapped", "bias-shared"])
def test_vmap_with_a_broadcast_bias(kernel_calls, bias_axes):
    """vmap of the gradient with a bias whose batch axis broadcasts (size 1): one kernel call, and
    per mapped element the gradients of its own problem."""
    rng = rng_for("cuda-path-vmap-bias", str(bias_axes))
    q, k, v = (x.reshape(3, 2, *x.shape[1:]) for x in qkv(rng, jnp.bfloat16, 6, 16, 24, 2, 1, 32))
    in_axes = (0, 0, 0, 0) if bias_axes == (0, 3) else (0, None, None, 0) if bias_axes == (0,) else (0, 0, 0, None)
    k, v = (x if in_axes[1] == 0 else x[0] for x in (k, v))
    bias_shape = (3, 1, 2, 16, 24) if in_axes[3] == 0 else (1, 2, 16, 24)
    bias = jnp.asarray(rng.normal(size=bias_shape), jnp.float32)
    mask = jnp.asarray(rng.random((1, 1, 16, 24)) < 0.8)
    kw = {"mask": mask, "is_causal": True}
    mine = jax.vmap(jax.grad(_loss("cuda", kw), argnums=(0, 1, 2, 3)), in_axes=in_axes)(q, k, v, bias)
    assert kernel_calls[-1][0] == "jax_flash_bwd" and kernel_calls[-1][1][0] == (6, 16, 2, 32)  # folded
    for i in range(3):
        pick = lambda x, axis: x[i] if axis == 0 else x  # noqa: E731
        args = [pick(x, axis) for x, axis in zip((q, k, v, bias), in_axes)]
        ref = jax.grad(_loss("xla", kw), argnums=(0, 1, 2, 3))(*args)
        for j, (g, r) in enumerate(zip(mine, ref)):
            assert reference.rel_error(g[i], r) < 2e-2, (i, j)


def test_handlers_are_registered_for_cuda_graphs(monkeypatch):
    """Every handler is registered for the CUDA platform as command-buffer compatible: jax passes
    XLA only the traits given at registration, and without this one XLA launches each of our calls
    from the host instead of capturing the step into a CUDA graph."""
    registered = []
    module = types.SimpleNamespace(registrations=lambda: {"jax_flash_fwd": object(), "jax_flash_decode": object()})
    monkeypatch.setattr(_ffi, "extension", lambda: module)
    monkeypatch.setattr(jax.ffi, "register_ffi_target", lambda *a, **kw: registered.append((a, kw)))
    _ffi.register_targets.cache_clear()
    try:
        assert _ffi.register_targets() == ("jax_flash_fwd", "jax_flash_decode")
    finally:
        _ffi.register_targets.cache_clear()
    compatible = xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
    assert [(a[0], kw.get("platform"), kw.get("traits")) for a, kw in registered] == [
        ("jax_flash_fwd", "CUDA", compatible), ("jax_flash_decode", "CUDA", compatible)]  # fmt: skip


def _smaller_gpu(monkeypatch, capability, smem_bytes):
    """The stand-in module's mma.sync (and Turing) backward takes `smem_bytes` a block on a GPU of `capability`."""
    module = types.SimpleNamespace(sm80_backward_smem_bytes=lambda head_dim: smem_bytes,
                                   sm80_backward_usual_smem_bytes=lambda head_dim: smem_bytes,
                                   sm75_backward_smem_bytes=lambda head_dim: smem_bytes)
    monkeypatch.setattr(_ffi, "extension", lambda: module)
    monkeypatch.setattr(_ffi, "device_capability", lambda: capability)


@pytest.mark.parametrize("capability", sorted(_ffi.SMEM_OPTIN_BY_CAPABILITY) + [(12, 9)])
def test_backward_kernels_fit_the_gpus_shared_memory(monkeypatch, capability):
    """The rule, on every GPU of the table and one it does not list: a backward fits where its
    bytes a block are within the GPU's opt-in limit (an unlisted GPU of 8.0 or later: the smallest
    such limit), and Hopper's own backward fits on 9.0 whatever the mma.sync one would take."""
    monkeypatch.delenv(_ffi.SMEM_LIMIT_ENV, raising=False)
    monkeypatch.delenv(_plan.KERNELS_ENV, raising=False)
    listed = {c: b for c, b in _ffi.SMEM_OPTIN_BY_CAPABILITY.items() if c >= (8, 0)}
    limit = _ffi.SMEM_OPTIN_BY_CAPABILITY.get(capability, min(listed.values()))
    for smem_bytes, head_dim in [(limit, 128), (limit + 1, 128), (limit, 96), (limit + 1, 96)]:
        _smaller_gpu(monkeypatch, capability, smem_bytes)
        hopper_own = capability == (9, 0) and head_dim in _contract.BWD_SM90_HEAD_DIMS
        assert _plan.backward_kernels_fit(_plan.family(), head_dim) is (hopper_own or smem_bytes <= limit), (smem_bytes, head_dim)


def test_a_shared_memory_limit_set_for_tests(monkeypatch):
    """JAX_FLASH_SMEM_LIMIT replaces the GPU's limit; with JAX_FLASH_KERNELS=sm80 the Hopper backward
    is not taken, so an H100 checks the mma.sync kernels as an sm_86 GPU would."""
    _smaller_gpu(monkeypatch, (9, 0), 116736)
    monkeypatch.setenv(_plan.KERNELS_ENV, "sm80")
    assert _plan.backward_kernels_fit(_plan.family(), 64)
    monkeypatch.setenv(_ffi.SMEM_LIMIT_ENV, "101376")
    assert _ffi.smem_limit() == 101376 and not _plan.backward_kernels_fit(_plan.family(), 64)
    monkeypatch.setenv(_ffi.SMEM_LIMIT_ENV, "99KB")
    with pytest.raises(ValueError, match=_ffi.SMEM_LIMIT_ENV):
        _ffi.smem_limit()


def test_the_backward_kernels_take_the_forced_shared_memory_limit(kernel_calls, monkeypatch):
    """JAX_FLASH_SMEM_LIMIT reaches the backward's launcher (which picks tiles within it); unset, 0
    lets the launcher take the GPU's own limit."""
    rng = rng_for("cuda-path-smem-attr")
    q, k, v = qkv(rng, jnp.bfloat16, 2, 40, 56, 4, 2, 64)
    for forced, expected in [(None, 0), ("101376", 101376)]:
        if forced is None:
            monkeypatch.delenv(_ffi.SMEM_LIMIT_ENV, raising=False)
        else:
            monkeypatch.setenv(_ffi.SMEM_LIMIT_ENV, forced)
        jax.grad(_loss("cuda", {}), (0, 1, 2))(q, k, v)
        assert int(kernel_calls.attrs["jax_flash_bwd"]["smem_limit"]) == expected


def test_the_kernels_fit_the_smaller_gpus():
    """The compiled module's shared memory a block of the mma.sync kernels (cuda/sm80/config.cuh,
    wide_fwd/config.cuh), which the dispatch weighs against the GPU's: the forward within sm_86/89's
    99 KB at every head dim up to 256; the smallest backward tiles within it at 32, 64, 96 and
    128, within an A100's 163 KB at 256. Needs the compiled extension (CI's first environment
    builds it; no GPU needed)."""
    module = _ffi.extension()
    if module is None:
        pytest.skip("the CUDA extension is not built in this environment")
    ampere, ada = _ffi.SMEM_OPTIN_BY_CAPABILITY[(8, 0)], _ffi.SMEM_OPTIN_BY_CAPABILITY[(8, 9)]
    for head_dim in (32, 64, 96, 128, 192, 256):
        assert 0 < module.sm80_forward_smem_bytes(head_dim) <= ada, head_dim
    for head_dim, limit in {32: ada, 64: ada, 96: ada, 128: ada, 256: ampere}.items():
        assert 0 < module.sm80_backward_smem_bytes(head_dim) <= limit, head_dim
    assert module.sm80_backward_smem_bytes(256) > ada
    # The mma.sync forward above 256 (cuda/sm80/wide_fwd/config.cuh): every head dim within an
    # A100's, 320 alone within sm_86/89's.
    for head_dim in (320, 384, 448, 512):
        assert 0 < module.sm80_wide_forward_smem_bytes(head_dim) <= ampere, head_dim
        assert (module.sm80_wide_forward_smem_bytes(head_dim) <= ada) == (head_dim == 320), head_dim


@pytest.mark.parametrize("case", ["causal", "bias", "lengths_causal"])
def test_a_backward_beyond_the_gpus_shared_memory_takes_the_xla_path(kernel_calls, monkeypatch, case):
    """On a GPU whose shared memory the backward kernels exceed, auto mode keeps the forward kernels
    and takes the gradients from the xla path's backward (the same values, no backward kernel);
    implementation="cuda" says why it cannot differentiate the call."""
    _smaller_gpu(monkeypatch, (8, 6), 116736)
    rng = rng_for("cuda-path-smem", case)
    b, t, s, n, kv_heads, h = 2, 40, 56, 4, 2, 40
    q, k, v = qkv(rng, jnp.bfloat16, b, t, s, n, kv_heads, h)
    kw = CASES[case](rng, b, n, t, s)
    args = (q, k, v) + ((kw["bias"],) if "bias" in kw else ())
    argnums = tuple(range(len(args)))
    grads = jax.grad(_loss(None, kw), argnums)(*args)
    for mine, ref in zip(grads, jax.grad(_loss("xla", kw), argnums)(*args), strict=True):
        assert mine.shape == ref.shape and mine.dtype == ref.dtype
        assert reference.rel_error(mine, ref) < 2e-2
    targets = [target for target, _ in kernel_calls]
    assert "jax_flash_fwd" in targets and "jax_flash_bwd" not in targets
    with pytest.raises(ValueError, match="cannot differentiate this call.*shared memory"):
        jax.grad(_loss("cuda", kw), argnums)(*args)


@pytest.mark.parametrize("h,padded", [(300, 320), (512, 512), (576, 640), (1000, 1024)])
def test_head_dims_above_256_take_the_forward_kernel_and_the_xla_backward(kernel_calls, h, padded):
    """Above 256 (Hopper only): the forward kernel at a multiple of 64 up to 512, of 128 above (a
    pair of CTAs, each half the columns), zero-padded; the gradients from the xla path's backward
    on its residuals; implementation="cuda" cannot differentiate."""
    rng = rng_for("cuda-path-wide", h)
    q, k, v = qkv(rng, jnp.bfloat16, 2, 40, 56, 4, 2, h)
    kw = {"is_causal": True}
    out = jax_flash.attention(q, k, v, implementation="cuda", **kw)
    assert reference.rel_error(out, jax_flash.attention(q, k, v, implementation="xla", **kw)) < 1e-2
    (target, shapes), *_ = kernel_calls
    assert target == "jax_flash_fwd" and shapes[0] == (2, 40, 4, padded)
    grads = jax.grad(_loss(None, kw), (0, 1, 2))(q, k, v)
    for mine, ref in zip(grads, jax.grad(_loss("xla", kw), (0, 1, 2))(q, k, v), strict=True):
        assert mine.shape == ref.shape and reference.rel_error(mine, ref) < 2e-2
    assert "jax_flash_bwd" not in [target for target, _ in kernel_calls]
    with pytest.raises(ValueError, match="no backward kernels above head dim 256"):
        jax.grad(_loss("cuda", kw), (0, 1, 2))(q, k, v)


@pytest.mark.parametrize("case", ["ampere", "sm80 kernels"])
def test_head_dims_above_256_run_the_mma_sync_forward_off_hopper(kernel_calls, monkeypatch, case):
    """Off Hopper (or with JAX_FLASH_KERNELS=sm80) the mma.sync forward runs above 256 where its
    shared memory fits, with the xla path's values and gradients."""
    if case == "ampere":
        monkeypatch.setattr(_ffi, "device_capability", lambda: (8, 0))
    else:
        monkeypatch.setenv(_plan.KERNELS_ENV, "sm80")
    q, k, v = qkv(rng_for("cuda-path-wide-sm80", case), jnp.bfloat16, 2, 40, 56, 4, 2, 300)
    kw = {"is_causal": True}
    assert jax_flash.chosen_implementation(q, k, v, **kw) == "cuda"
    out = jax_flash.attention(q, k, v, implementation="cuda", **kw)
    assert reference.rel_error(out, jax_flash.attention(q, k, v, implementation="xla", **kw)) < 1e-2
    (target, shapes), *_ = kernel_calls
    assert target == "jax_flash_fwd" and shapes[0] == (2, 40, 4, 320)
    grads = jax.grad(_loss(None, kw), (0, 1, 2))(q, k, v)
    for mine, ref in zip(grads, jax.grad(_loss("xla", kw), (0, 1, 2))(q, k, v), strict=True):
        assert reference.rel_error(mine, ref) < 2e-2


@pytest.mark.parametrize("case,path", [
    ("every score", "xla-dense"), ("causal", "cuda"), ("window", "cuda"), ("lengths", "cuda"), ("segments", "cuda"),
    ("over the budget", "cuda"), ("512", "cuda"), ("implementation='cuda'", "cuda"),
])  # fmt: skip
def test_auto_mode_takes_the_dense_path_where_it_outruns_the_pairs(kernel_calls, monkeypatch, case, path):
    """Above 512 (the pairs of CTAs), where every score is visible and the scores fit the dense
    budget, XLA's dense products are faster than the kernels (cuda_impl.dense_is_faster): auto mode
    takes the dense xla path. A band, lengths or segments, scores over the budget, head dims up to
    512 or implementation='cuda' keep the kernels."""
    monkeypatch.setattr(dense_impl, "budget_bytes", lambda: 0 if case == "over the budget" else 2**30)
    h = 512 if case == "512" else 640
    q, k, v = qkv(rng_for("cuda-path-dense-or-pairs", case), jnp.bfloat16, 1, 16, 16, 2, 2, h)
    ids = jnp.arange(16)[None] // 8
    kw = {"causal": {"is_causal": True}, "window": {"local_window_size": (4, 4)},
          "lengths": {"key_value_seq_lengths": jnp.array([9])}, "segments": {"q_segment_ids": ids, "kv_segment_ids": ids},
          "implementation='cuda'": {"implementation": "cuda"}}.get(case, {})  # fmt: skip
    assert jax_flash.chosen_implementation(q, k, v, **kw) == path
    out = jax_flash.attention(q, k, v, **kw)
    assert bool(kernel_calls) == (path == "cuda")
    assert reference.rel_error(out, jax_flash.attention(q, k, v, **{**kw, "implementation": "xla"})) < 1e-2


@pytest.mark.parametrize("case,reason", [
    ("sm_86 at 384", "needs 103424 bytes of shared memory a block; this GPU allows 101376"),
    ("bias", "without a bias"), ("mask over queries and keys", "a mask that varies along both queries and keys"),
    ("1088", "head dim 1088 is above the largest supported \\(1024\\)"),
    ("ampere at 576", "head dims above 512 \\(got 576\\) run on Hopper's kernels alone"),
])  # fmt: skip
def test_head_dims_above_256_elsewhere_take_the_other_paths(kernel_calls, monkeypatch, case, reason):
    h = {"1088": 1088, "ampere at 576": 576, "sm_86 at 384": 384}.get(case, 320)
    q = jnp.zeros((1, 16, 2, h), jnp.bfloat16)
    bias = jnp.zeros((1, 2, 16, 16), jnp.float32) if case == "bias" else None
    mask = jnp.tril(jnp.ones((16, 16), bool))[None, None] if case == "mask over queries and keys" else None
    if case == "sm_86 at 384":  # the mma.sync forward's 101 KB at 384 (cuda/sm80/wide_fwd/config.cuh)
        monkeypatch.setattr(_ffi, "device_capability", lambda: (8, 6))
        monkeypatch.setattr(_ffi.extension(), "sm80_wide_forward_smem_bytes", lambda head_dim: 103424)
    if case == "ampere at 576":
        monkeypatch.setattr(_ffi, "device_capability", lambda: (8, 0))
    assert jax_flash.chosen_implementation(q, q, q, bias=bias, mask=mask).startswith("xla")
    with pytest.raises(ValueError, match=reason):
        jax_flash.attention(q, q, q, bias, mask, implementation="cuda")


@pytest.mark.parametrize("axis", ["keys", "queries"])
def test_head_dims_above_256_run_a_one_axis_mask_as_segments(kernel_calls, axis):
    """A padding mask (along the keys alone, or the queries alone) reaches the wide forward kernel
    as segment ids, with the xla path's values and gradients."""
    rng = rng_for("cuda-path-wide-mask", axis)
    q, k, v = qkv(rng, jnp.bfloat16, 2, 40, 56, 4, 2, 320)
    shape = (2, 1, 1, 56) if axis == "keys" else (2, 1, 40, 1)
    mask = jnp.asarray(rng.random(shape) > 0.3)
    out = jax_flash.attention(q, k, v, mask=mask, implementation="cuda")
    assert reference.rel_error(out, jax_flash.attention(q, k, v, mask=mask, implementation="xla")) < 1e-2
    (target, shapes), *_ = kernel_calls
    assert target == "jax_flash_fwd" and shapes[0] == (2, 40, 4, 320)
    assert jax_flash.chosen_implementation(q, k, v, mask=mask) == "cuda"
    kw = {"mask": mask}
    grads = jax.grad(_loss(None, kw), (0, 1, 2))(q, k, v)
    for mine, ref in zip(grads, jax.grad(_loss("xla", kw), (0, 1, 2))(q, k, v), strict=True):
        assert reference.rel_error(mine, ref) < 2e-2


@pytest.mark.parametrize("case,forward_dims,backward_dims", [
    ("192/128", (192, 128), (192, 128)),  # the pair's own kernels
    ("160/100", (192, 128), (192, 128)),  # padded up to the pair
    ("padding mask", (192, 128), (192, 128)),  # runs as segment ids
    # No bias in the pair's kernels: V padded to the query head dim, and the backward to 256.
    ("bias", (192, 192), (256, 256)),
    ("sm80 kernels", (192, 192), (256, 256)),
    ("decode", (192, 192), None),  # the decode kernels at the wider dim
])  # fmt: skip
def test_unequal_head_dims_take_their_own_kernels(kernel_calls, monkeypatch, case, forward_dims, backward_dims):
    """(192, 128) has a Hopper forward and backward of its own (V, O, dO and dV of 128 columns).
    Values and gradients match the xla path's."""
    h, hv = (160, 100) if case == "160/100" else (192, 128)
    t = 2 if case == "decode" else 40
    rng = rng_for("cuda-path-unequal", case)
    q, k, _ = qkv(rng, jnp.bfloat16, 2, t, 56, 4, 2, h)
    v = jnp.asarray(rng.normal(size=(2, 56, 2, hv)), jnp.bfloat16)
    kw = {"is_causal": True}
    if case == "padding mask":
        kw["mask"] = jnp.asarray(rng.random((2, 1, 1, 56)) > 0.3)
    if case == "bias":
        kw["bias"] = jnp.asarray(rng.normal(size=(1, 4, t, 56)), jnp.float32)
    if case == "sm80 kernels":
        monkeypatch.setenv(_plan.KERNELS_ENV, "sm80")
    if case == "decode":  # the fixture turns the decode kernels off
        monkeypatch.delenv(_decode.DECODE_ENV)
        monkeypatch.setattr(_decode, "sm_count", lambda: 132)
    out = jax_flash.attention(q, k, v, implementation="cuda", **kw)
    assert out.shape == (2, t, 4, hv)
    assert reference.rel_error(out, jax_flash.attention(q, k, v, implementation="xla", **kw)) < 1e-2
    (target, shapes), *_ = kernel_calls
    assert target == ("jax_flash_decode" if case == "decode" else "jax_flash_fwd")
    assert (shapes[0][-1], shapes[2][-1]) == forward_dims
    if case == "decode":
        return
    args = (q, k, v, kw["bias"]) if "bias" in kw else (q, k, v)
    grads = jax.grad(_loss(None, kw), (0, 1, 2))(*args)
    for mine, ref in zip(grads, jax.grad(_loss("xla", kw), (0, 1, 2))(*args), strict=True):
        assert mine.shape == ref.shape and reference.rel_error(mine, ref) < 2e-2
    bwd_shapes = dict(kernel_calls)["jax_flash_bwd"]
    assert (bwd_shapes[0][-1], bwd_shapes[2][-1]) == backward_dims
