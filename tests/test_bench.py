"""The benchmark runs end to end (on a CPU it compares the xla paths) and writes its plot."""

import types

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash.bench import cli, decode, ragged, timing
from jax_flash.bench import masks as bench_masks
from tests import reference


def test_quick_benchmark_table_and_plot(tmp_path, capsys):
    png, js = tmp_path / "bench.png", tmp_path / "bench.json"
    rows = cli.main(["--quick", "--plot", str(png), "--json", str(js)])
    out = capsys.readouterr().out
    assert {r["impl"] for r in rows} >= {"jax_flash", "xla"}
    assert all(r["tflops"] is not None and r["tflops"] > 0 for r in rows)
    assert "jax_flash / " in out and out.count("\n| ") >= 8  # header + 2 seqlens x 2 causal x 2 passes
    # Our ratio to the reference, per interleaved round: the table prints its median and range.
    ours = [r for r in rows if r["impl"] == "jax_flash"]
    assert all(len(r["vs_xla_rounds"]) == timing.ROUNDS and min(r["vs_xla_rounds"]) > 0 for r in ours)
    first = ours[0]["vs_xla_rounds"]
    assert f"{min(first):.2f}–{max(first):.2f})" in out
    assert png.stat().st_size > 10_000 and js.stat().st_size > 100


def test_masks_benchmark(capsys):
    rows = cli.main(["--masks"])
    assert [r["case"] for r in rows][0] == "causal" and len(rows) == len(bench_masks.cases(64, jnp.float32)) == 9
    assert {r["head_dim"] for r in rows} == {128}  # --head-dims picks others
    assert all(r["fwd"] > 0 and r["fwd_bwd"] > r["fwd"] for r in rows)
    # Fractions of causal round by round (the cases interleaved, as timing.measure times them).
    assert all(len(r["fwd_rounds"]) == len(r["fwd_bwd_rounds"]) == timing.ROUNDS for r in rows)
    assert rows[0]["fwd_rounds"] == [1.0] * timing.ROUNDS and min(rows[1]["fwd_rounds"]) > 0
    out = capsys.readouterr().out
    assert "| 8 packed documents (causal) |" in out and "| softcap 30 (causal) |" in out and "| bias [1, 1, T, S] (causal) |" in out and "fwd / causal" in out


def test_learned_bias_case_differentiates_the_bias_and_changes_nothing_else():
    """The learned-bias case sends a cotangent to the bias (so the backward computes dbias) through
    a zero multiple of q: q, k and v get the gradients of the plain bias case."""
    seqlen = 64
    case = bench_masks.cases(seqlen, jnp.float32)
    learned, plain = (bench_masks._ours(case[name]) for name in ("learned bias [1, 1, T, S] (causal)",
                                                                  "bias [1, 1, T, S] (causal)"))
    q, k, v = (jax.random.normal(jax.random.key(i), (1, seqlen, 2, 16)) for i in range(3))
    loss = lambda attn: lambda q, k, v: (attn(q, k, v, True) ** 2).sum()  # noqa: E731
    grads, plain_grads = (jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v) for f in (learned, plain))
    for g, want in zip(grads, plain_grads):
        assert jnp.allclose(g, want, rtol=1e-5, atol=1e-6)
    # The learned case's backward makes one [1, 1, T, S] array more: dbias.
    learned_jaxpr, plain_jaxpr = (str(jax.make_jaxpr(jax.grad(loss(f)))(q, k, v)) for f in (learned, plain))
    assert learned_jaxpr.count(f"[1,1,{seqlen},{seqlen}]") > plain_jaxpr.count(f"[1,1,{seqlen},{seqlen}]")


def test_masks_benchmark_peer_rows_are_fractions_of_the_peers_causal(monkeypatch):
    """A peer (on a GPU cuDNN and FlashAttention-3; here XLA's attention stands in) runs the causal
    and window cases, each divided by the peer's own causal time, not by ours."""
    peer = lambda q, k, v, **kw: jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)  # noqa: E731
    monkeypatch.setattr(bench_masks, "peers", lambda on_gpu: {"stand-in": peer})
    rows = {r["case"]: r for r in bench_masks.run()}
    assert set(rows) == set(bench_masks.cases(64, jnp.float32)) | {f"stand-in: {c}" for c in bench_masks.PEER_CASES}
    assert rows["stand-in: causal"]["fwd_rounds"] == [1.0] * timing.ROUNDS
    assert rows["stand-in: causal"]["fwd_bwd_rounds"] == [1.0] * timing.ROUNDS
    window = rows["stand-in: window 512 (causal)"]
    assert len(window["fwd_rounds"]) == timing.ROUNDS and min(window["fwd_rounds"]) > 0
    assert "| stand-in: window 512 (causal) |" in bench_masks.table(list(rows.values()))


def test_gpu_loops_start_after_a_rest(monkeypatch):
    """On a GPU every timed loop starts after REST_SECONDS idle (the power cap made a loop's time
    depend on the loop before it); the untimed warm-up and calibration loops do not rest."""
    events = []
    monkeypatch.setattr(timing.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(timing.time, "sleep", lambda s: events.append(("rest", s)))
    real_loop = timing._loop_seconds

    def recorded_loop(fn, args, calls=10):
        events.append(("loop", calls))
        return real_loop(fn, args, calls)

    monkeypatch.setattr(timing, "_loop_seconds", recorded_loop)

    def attn(q, k, v, causal):
        return jax_flash.attention(q, k, v, is_causal=causal, implementation="xla")

    shape = timing.Shape(head_dim=32, seqlen=64, causal=True, batch=1, heads=2)
    samples = timing.measure({"a": attn, "b": attn}, shape, jnp.float32, rounds=2)
    assert all(len(per_round) == 2 for per_round in samples.values())
    timed = [i for i, e in enumerate(events) if e[0] == "loop" and i > 0 and events[i - 1][0] == "rest"]
    assert len(timed) == 2 * 2 * 2  # rounds x implementations x (forward, forward + backward)
    assert all(events[i - 1] == ("rest", timing.REST_SECONDS) for i in timed)
    assert sum(e[0] == "rest" for e in events) == len(timed)


def test_decode_benchmark(tmp_path, capsys):
    """On a CPU: the small grid, jax_flash (dense and paged) and XLA, a time and a byte rate for
    every row, the table and the plot."""
    png = tmp_path / "decode.png"
    rows = cli.main(["--decode", "--plot", str(png)])
    assert {r["impl"] for r in rows} == {"jax_flash", "paged 64", "paged 16", "xla"}
    assert all(r["seconds"] > 0 and r["bytes_per_second"] > 0 for r in rows)
    assert {(r["batch"], r["cache"], r["queries"]) for r in rows} == {(1, 256, 1), (1, 256, 4), (2, 1024, 1),
                                                                     (2, 1024, 4)}  # fmt: skip
    out = capsys.readouterr().out
    assert "| 2 | 1024 | 4 |" in out and "xla / jax_flash" in out and png.stat().st_size > 10_000


def test_decode_dispatch_spans():
    """The GPU time of each dispatch in a profiler trace: from its first kernel to the end of its
    last, the gaps between its kernels counted, host events and other processes ignored; the
    dispatches told apart by the idle time between them."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]  # fmt: skip
    kernel = lambda ts, dur, pid=1: {"ph": "X", "pid": pid, "ts": ts, "dur": dur, "name": "k"}  # noqa: E731
    first = [kernel(1000, 10), kernel(1012, 5), kernel(1030, 3)]  # 1000 -> 1033
    second = [kernel(200_000, 7), kernel(200_009, 1)]  # 200000 -> 200010
    host = [kernel(500, 100_000, pid=2)]
    events = meta + second + host + first  # in any order
    assert decode.dispatch_spans(events, 2) == pytest.approx([33e-6, 10e-6])
    with pytest.raises(RuntimeError, match="2 dispatches, not 3"):
        decode.dispatch_spans(events, 3)


def test_unequal_and_long_head_dims_with_fixed_heads(capsys):
    """--head-dims takes D:DV (a value head dim other than the query/key one) beside plain dims,
    and --heads / --batch fix the shape (the head-dim issue's B = 1, 8 heads): rows for each, a
    FLOP count from both dims, the table labelling 48/32."""
    rows = cli.main(["--head-dims", "48:32", "320", "--heads", "2", "--batch", "1", "--seqlens", "64"])
    assert {(r["d"], r["heads"], r["batch"]) for r in rows} == {("48/32", 2, 1), ("320", 2, 1)}
    assert all(r["seconds"] and r["tflops"] for r in rows if r["impl"] in ("jax_flash", "xla"))
    padded = {r["d"]: r["seconds"] for r in rows if r["impl"] == "jax_flash, V padded"}
    assert padded["48/32"] and padded["320"] is None  # the padded column only where V is narrower
    unequal = timing.Shape(48, 64, False, 1, 2, 32)
    assert unequal.flops(False) == 2.0 * 2 * 64**2 * (48 + 32)
    assert unequal.flops(True) == 2.0 * 2 * 64**2 * (3 * 48 + 2 * 32)
    assert timing.Shape(64, 64, True, 1, 2).flops(True) == 2.5 * timing.Shape(64, 64, True, 1, 2).flops(False)
    assert "| 48/32 | 64 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["--head-dims", "48:x"])


def test_tokamax_columns_only_where_it_imports(monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "tokamax", None)  # an import of it fails
    assert not any(name.startswith("tokamax") for name in timing.peers(on_gpu=True))
    calls = []
    stand_in = types.SimpleNamespace(dot_product_attention=lambda q, k, v, **kw: calls.append(kw) or q)
    monkeypatch.setitem(sys.modules, "tokamax", stand_in)
    found = timing.peers(on_gpu=True)
    assert {"tokamax_mosaic", "tokamax_triton"} <= set(found) and "cudnn" in found
    q = jnp.ones((1, 8, 2, 16))
    assert found["tokamax_triton"](q, q, q, True, (4, 0)) is q
    assert calls == [dict(is_causal=True, local_window_size=(4, 0), implementation="triton")]
    assert timing.peers(on_gpu=False) == {}


@pytest.mark.parametrize("kind, peak", [("NVIDIA H200", 4.8e12), ("NVIDIA H100 80GB HBM3", 3.35e12),
                                        ("NVIDIA H100 PCIe", 2.0e12), ("cpu", 3.35e12)])  # fmt: skip
def test_the_decode_fraction_is_of_this_devices_hbm_peak(monkeypatch, kind, peak):
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(device_kind=kind)])
    name, rate = decode.hbm_peak()
    assert rate == peak and (("not known" in name) == (kind == "cpu"))
    row = {"batch": 1, "cache": 1024, "queries": 1, "impl": "jax_flash", "seconds": 1e-3, "bytes_per_second": peak / 2}
    assert "(50%)" in decode.table([row, {**row, "impl": "xla"}])


def test_sinks_benchmark(capsys):
    """--sinks: both gpt-oss layer kinds and a decode step, each timed with sinks against without
    in one run (a ratio a row)."""
    rows = cli.main(["--sinks"])
    assert [(r["kind"], r["layer"]) for r in rows] == [
        ("training", "window 128"), ("training", "full causal"), ("decode", "batch 1, cache 256")]
    assert all(r["fwd_ratio"] > 0 and r["fwd"] > 0 for r in rows)
    assert all(r["fwd_bwd_ratio"] > 0 for r in rows if r["kind"] == "training")
    assert "fwd + bwd: with / without" in capsys.readouterr().out


def test_ragged_benchmark(capsys):
    """--ragged: a mixed step timed as one ragged call and as the separate calls on its work, which
    compute the same rows (so the comparison is of the same work)."""
    rows = cli.main(["--ragged"])
    assert [(r["kind"], r["prefills"], r["decodes"]) for r in rows] == [("mixed", 1, 3)]
    assert all(r["ragged"] > 0 and r["separate"] > 0 and r["ratio"] > 0 for r in rows)
    assert "ragged / separate" in capsys.readouterr().out
    (step,) = ragged.grid(on_gpu=False)
    ragged_args, (prefills, decodes) = ragged.problem(step, jnp.float32)
    out = jax_flash.ragged_paged_attention(*ragged_args)
    separate = ragged._separate(prefills, decodes)
    chunk = step.prefills[0][0]
    assert reference.rel_error(out[:chunk], separate[0][0]) < 1e-5
    assert reference.rel_error(out[chunk:], separate[1][:, 0]) < 1e-5
