"""`python -m jax_flash.bench`: the command line over the benchmark's tables (training.py, masks.py,
ring.py, decode.py, sinks.py, ragged.py)."""

from __future__ import annotations

import argparse
import json

import jax

from jax_flash.bench import decode, masks, ragged, ring, sinks, training

def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m jax_flash.bench", description=training.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a short grid")
    parser.add_argument("--head-dims", type=training.head_dims_arg, nargs="+",
                        help="head dims to run: D, or D:DV for a value head dim DV other than the query/key one")
    parser.add_argument("--heads", type=int, help="heads (default: 2048 / head dim)")
    parser.add_argument("--batch", type=int, help="batch (default: 16384 tokens / seqlen)")
    parser.add_argument("--seqlens", type=int, nargs="+", help="sequence lengths to run")
    parser.add_argument("--plot", metavar="PNG", help="write TFLOP/s vs seqlen per implementation")
    parser.add_argument("--json", metavar="FILE", help="write every measurement as JSON")
    parser.add_argument("--masks", action="store_true", help="time masks and the soft cap against causal instead")
    parser.add_argument("--ring", action="store_true", help="time ring attention over every GPU instead")
    parser.add_argument("--decode", action="store_true", help="time decode steps against a KV cache instead")
    parser.add_argument("--kv-dtype", choices=("model", "fp8"), default="model",
                        help="with --decode: fp8 also times jax_flash's fp8 caches (float8_e4m3fn)")
    parser.add_argument("--sinks", action="store_true", help="time gpt-oss's attention with sinks against without")
    parser.add_argument("--ragged", action="store_true",
                        help="time a serving step's ragged batch against the separate calls on its work")
    parser.add_argument("--ring-seqlen", type=int, default=32768, help="tokens per device for --ring")
    args = parser.parse_args(argv)
    if args.ring:
        rows = ring.run(args.ring_seqlen)
        print(f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind}, jax {jax.__version__}, "
              f"{args.ring_seqlen} tokens per device, 16 heads, d = 128, bf16")
        print(ring.table(rows))
        return rows
    if args.ragged:
        rows = ragged.run()
        print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, {ragged.HEADS} / {ragged.KV_HEADS} "
              f"heads, d = {ragged.HEAD_DIM}")
        print(ragged.table(rows))
        return rows
    if args.sinks:
        rows = sinks.run()
        print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, {sinks.HEADS} / {sinks.KV_HEADS} "
              f"heads, d = {sinks.HEAD_DIM} (gpt-oss)")
        print(sinks.table(rows))
        return rows
    if args.decode:
        rows = decode.run(args.kv_dtype)
        print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, {decode.HEADS} / "
              f"{decode.KV_HEADS} heads, d = {decode.HEAD_DIM}, cold L2, time per call "
              f"({'GPU time from the profiler' if jax.default_backend() == 'gpu' else 'wall clock'}), "
              f"HBM fraction of the peak ({decode.hbm_peak()[0]})")
        print(decode.table(rows))
        if args.plot:
            decode.plot(rows, args.plot)
        return rows
    if args.masks:
        rows = []
        for head_dim, value_head_dim in args.head_dims or ((128, None),):
            if value_head_dim is not None:
                parser.error("--masks times equal head dims only")
            these = masks.run(head_dim)
            print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, d = {head_dim}")
            print(masks.table(these))
            rows += these
        return rows
    rows = training.run(args)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, TFLOP/s")
    print(training.table(rows))
    if args.plot:
        training.plot(rows, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows
