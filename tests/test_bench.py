"""The benchmark runs end to end (on a CPU it compares the xla paths) and writes its plot."""

import jax.numpy as jnp

from jax_flash import bench, bench_masks


def test_quick_benchmark_table_and_plot(tmp_path, capsys):
    png, js = tmp_path / "bench.png", tmp_path / "bench.json"
    rows = bench.main(["--quick", "--plot", str(png), "--json", str(js)])
    out = capsys.readouterr().out
    assert {r["impl"] for r in rows} >= {"jax_flash", "xla"}
    assert all(r["tflops"] is not None and r["tflops"] > 0 for r in rows)
    assert "jax_flash / " in out and out.count("\n| ") >= 8  # header + 2 seqlens x 2 causal x 2 passes
    # Our ratio to the reference, per interleaved round: the table prints its median and range.
    ours = [r for r in rows if r["impl"] == "jax_flash"]
    assert all(len(r["vs_xla_rounds"]) == bench.ROUNDS and min(r["vs_xla_rounds"]) > 0 for r in ours)
    first = ours[0]["vs_xla_rounds"]
    assert f"{min(first):.2f}–{max(first):.2f})" in out
    assert png.stat().st_size > 10_000 and js.stat().st_size > 100


def test_masks_benchmark(capsys):
    rows = bench.main(["--masks"])
    assert [r["case"] for r in rows][0] == "causal" and len(rows) == len(bench_masks.cases(64, jnp.float32)) == 7
    assert all(r["fwd"] > 0 and r["fwd_bwd"] > r["fwd"] for r in rows)
    # Fractions of causal round by round (the cases interleaved, as bench.measure times them).
    assert all(len(r["fwd_rounds"]) == len(r["fwd_bwd_rounds"]) == bench.ROUNDS for r in rows)
    assert rows[0]["fwd_rounds"] == [1.0] * bench.ROUNDS and min(rows[1]["fwd_rounds"]) > 0
    out = capsys.readouterr().out
    assert "| 8 packed documents (causal) |" in out and "| softcap 30 (causal) |" in out and "| bias [1, 1, T, S] (causal) |" in out and "fwd / causal" in out
