"""Writes cuda/generated/: one .cu per (kernel, architecture, dtype, head dim) holding its variants
(those of one kernel family: a bias variant that Hopper GPUs run too has a file of its own), so the
build compiles them in parallel while each file's fixed cost (the host passes, parsing the
headers) is paid once for all its variants; the family of each (families.cmake: which targets
CMakeLists.txt compiles it for), and the kernel contract, once for C++ (cuda/generated/contract.h) and
once for Python (jax_flash/_contract.py): the head dims with kernels, the layout of the segment
chunk summaries, the scratch sizes and row multiples the Python layer allocates for the kernels;
and, from scripts/ffi_operands.py's table, each custom call's operands (cuda/generated/ffi_operands.h
and jax_flash/_operands.py). Nothing of it is written by hand anywhere else. `--check` fails when a
file is not what this script writes.

    python scripts/generate_instantiations.py [--check]
"""

import argparse
import pathlib
import sys

import ffi_operands

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "cuda" / "generated"
PY_CONTRACT = ROOT / "jax_flash" / "_contract.py"
PY_OPERANDS = ROOT / "jax_flash" / "_operands.py"
DTYPES = {"fp16": "__half", "bf16": "__nv_bfloat16"}
# Head dims with kernels, per kernel family; other head dims are zero-padded up by the Python layer.
HEAD_DIMS = {
    "fwd": (32, 64, 96, 128, 192, 256),
    "bwd": (32, 64, 96, 128, 256),  # 192 runs the 256 kernels, zero-padded
    "fwd_sm90": (64, 128, 192, 256),  # Hopper (wgmma) forward; the others run the sm80 kernels there
    "bwd_sm90": (64, 128, 256),
    "bwd_sm90_no_bias": (192,),  # Hopper backward without a bias or mask; with one, 192 runs the 256 kernels
    # Hopper forward above 256 (no bias or mask; xla's backward); above 512 pairs of CTAs split the head dim
    "fwd_sm90_wide": (320, 384, 448, 512, 640, 768, 896, 1024),
    "fwd_sm80_wide": (320, 384, 448, 512),  # mma.sync forward above 256 (the same)
    "decode": (32, 64, 96, 128, 192, 256),
    "decode_fp8": (64, 128),  # decode over fp8 caches (whole 64-byte tile rows, Q in registers)
    # Turing (sm_75): fp16 only, no bias; other head dims up to 128 pad up, the rest take the xla path
    "fwd_sm75": (64, 96, 128),
    "bwd_sm75": (64, 96, 128),
}
# (query/key head dim, value head dim) pairs with kernels of their own; other unequal pairs are
# zero-padded to equal dims by the Python layer.
HEAD_DIM_PAIRS = {
    "fwd_sm90_unequal": ((192, 128),),  # Hopper forward (no bias or mask)
    "bwd_sm90_unequal": ((192, 128),),  # Hopper backward (no bias or mask)
}
# name -> (value, meaning): constants that both the kernels and the Python layer depend on.
CONSTANTS = {
    "MASK_CHUNK": (64, "queries or keys summarised by one MaskChunk of the segment ids"),
    "STATS_ROW_MULTIPLE": (640, "rows of the backward's statistics scratch: a multiple of every query block"),
    "FWD_SCRATCH_COUNTERS": (3, "int32 counters at the start of the sm90 forward's scratch"),
    "FWD_SCRATCH_TILE_ROWS": (128, "the sm90 forward's scratch holds two entries a tile of this many rows"),
    "DECODE_TILE_ROWS": (16, "packed query rows of one decode CTA (one m16 tile)"),
    "DECODE_BLOCK_KEYS": (16, "keys a decode warp reads a step; pages are whole multiples of it"),
    "MAX_DECODE_SPLITS": (128, "splits of a decode tile's keys, at most"),
    "RAGGED_WORK_FIELDS": (4, "int32 fields of a ragged work item: sequence, first packed row, first query row, queries"),
    "PREFILL_BLOCK_ROWS": (128, "queries of one prefill item of a ragged batch (its fields: sequence, first query, "
                           "first query row, queries)"),
    "DQ_COUNTER_ROWS": (32, "query rows per dQ turn or ticket counter: at most the smallest query block"),
}
# The launchers' tile shapes that depend on the call (Tiles in contract.h, TILES in _contract.py):
# name -> (value, meaning). jax_flash/_plan.py picks one per call and the custom calls' `tiles`
# attribute carries it; a launcher runs the one it is given or refuses it (dispatch.cu).
TILES = {
    "USUAL": (0, "the kernel's usual tiles for its head dim and variant"),
    "TALL": (1, "Hopper forward, head dim 64: 192-query tiles"),
    "WIDE_KEYS": (2, "Hopper forward, head dims 128 and 256: wider key blocks"),
    "STEPS_OF_80": (3, "Hopper backward, head dim 128: 80-query steps"),
    "COMPACT": (4, "mma.sync backward: the compact tiles, for GPUs whose shared memory the usual ones exceed"),
}
assert sorted(value for value, _ in TILES.values()) == list(range(len(TILES))), "Tiles are 0 .. n - 1"
# The launchers that take a Tiles argument (the others have one tile shape: USUAL).
TAKES_TILES = ("run_fwd_sm90", "run_bwd_sm90", "run_bwd_sm80")
# The int32 fields of one segment-chunk summary (jax_flash/_masks.py writes them, mask.cuh reads).
MASK_CHUNK_FIELDS = ("segment_min", "segment_max", "other_begin", "other_end", "one_begin", "one_end")
VARIANTS = {"": "kPlain", "_masked": "kMasked", "_softcap": "kSoftcap", "_bias": "kEverything"}  # suffix -> Variant
# The kernels that take no bias or mask (above 256, unequal head dims, the Hopper backward at 192).
BIAS_FREE_VARIANTS = {suffix: variant for suffix, variant in VARIANTS.items() if variant != "kEverything"}
KERNELS = {  # (kernel, arch) -> (launcher header, launcher, params, head dims, variants)
    ("fwd", "sm80"): ("launch/run_sm80.cuh", "run_fwd_sm80", "FwdParams", HEAD_DIMS["fwd"], VARIANTS),
    ("bwd", "sm80"): ("launch/run_sm80.cuh", "run_bwd_sm80", "BwdParams", HEAD_DIMS["bwd"], VARIANTS),
    ("fwd", "sm90"): ("launch/run_sm90.cuh", "run_fwd_sm90", "FwdParams", HEAD_DIMS["fwd_sm90"], VARIANTS),
    ("bwd", "sm90"): ("launch/run_sm90.cuh", "run_bwd_sm90", "BwdParams", HEAD_DIMS["bwd_sm90"], VARIANTS),
    ("bwd_no_bias", "sm90"): ("launch/run_sm90.cuh", "run_bwd_sm90", "BwdParams", HEAD_DIMS["bwd_sm90_no_bias"],
                              BIAS_FREE_VARIANTS),
    ("fwd_wide", "sm90"): ("launch/run_sm90_wide_fwd.cuh", "run_wide_fwd_sm90", "FwdParams",
                           HEAD_DIMS["fwd_sm90_wide"], BIAS_FREE_VARIANTS),
    ("fwd_wide", "sm80"): ("launch/run_sm80_wide_fwd.cuh", "run_wide_fwd_sm80", "FwdParams",
                           HEAD_DIMS["fwd_sm80_wide"], BIAS_FREE_VARIANTS),
    ("fwd_unequal", "sm90"): ("launch/run_sm90.cuh", "run_unequal_fwd_sm90", "FwdParams",
                              HEAD_DIM_PAIRS["fwd_sm90_unequal"], BIAS_FREE_VARIANTS),
    ("bwd_unequal", "sm90"): ("launch/run_sm90.cuh", "run_unequal_bwd_sm90", "BwdParams",
                              HEAD_DIM_PAIRS["bwd_sm90_unequal"], BIAS_FREE_VARIANTS),
    ("fwd", "sm75"): ("launch/run_sm75.cuh", "run_fwd_sm75", "FwdParams", HEAD_DIMS["fwd_sm75"], BIAS_FREE_VARIANTS),
    ("bwd", "sm75"): ("launch/run_sm75.cuh", "run_bwd_sm75", "BwdParams", HEAD_DIMS["bwd_sm75"], BIAS_FREE_VARIANTS),
    # Decode reads key lengths always, never segment ids or a bias: two variants.
    ("decode", "sm80"): ("launch/run_decode.cuh", "run_decode", "DecodeParams", HEAD_DIMS["decode"],
                         {"": "kMasked", "_softcap": "kSoftcap"}),
    ("decode_fp8", "sm80"): ("launch/run_decode.cuh", "run_decode", "DecodeParams", HEAD_DIMS["decode_fp8"],
                             {"": "kMasked", "_softcap": "kSoftcap"}),
    # The same kernels over a ragged batch's work list (ragged_paged_attention).
    ("ragged", "sm80"): ("launch/run_decode.cuh", "run_ragged", "DecodeParams", HEAD_DIMS["decode"],
                         {"": "kMasked", "_softcap": "kSoftcap"}),
    ("ragged_fp8", "sm80"): ("launch/run_decode.cuh", "run_ragged", "DecodeParams", HEAD_DIMS["decode_fp8"],
                             {"": "kMasked", "_softcap": "kSoftcap"}),
}
# The mma.sync kernels that a Hopper GPU runs only when a test forces that family: those of the
# (kernel, head dims) that the Hopper family has too, without a bias (dispatch.cu runs a bias of
# an odd or strided layout on the mma.sync kernels). Their sm_90a code is built for the tests alone.
HOPPER_HAS_TOO = {"fwd": HEAD_DIMS["fwd_sm90"], "bwd": HEAD_DIMS["bwd_sm90"], "fwd_wide": HEAD_DIMS["fwd_sm90_wide"]}
# The element types of an architecture's kernels, where not all of DTYPES (Turing has no bf16 mma.sync).
ARCH_DTYPES = {"sm75": ("fp16",)}
HEADER = """\
// Generated by scripts/generate_instantiations.py; do not edit.
#include "{header}"
"""
INSTANTIATION = """
template cudaError_t jax_flash::{launcher}<{types}, {head_dim}, jax_flash::Variant::{variant}>(
    const jax_flash::{params}&, {tiles}cudaStream_t);
"""
# The cache's K/V element types of the kernels whose launcher takes one as its second type
# argument (None: the queries').
KV_TYPES = {"decode": (None,), "decode_fp8": ("__nv_fp8_e4m3", "__nv_fp8_e5m2")}
KV_TYPES.update(ragged=KV_TYPES["decode"], ragged_fp8=KV_TYPES["decode_fp8"])


def _camel(name: str) -> str:
    return "k" + "".join(part.capitalize() for part in name.lower().split("_"))


def contract_header() -> str:
    lines = ["// Generated by scripts/generate_instantiations.py; do not edit. The kernel contract: what the",
             "// kernels and the Python layer (jax_flash/_contract.py, written from the same lists) both assume.",
             "#pragma once", "", "#include <utility>", "", "namespace jax_flash::contract {", ""]
    for name, (value, meaning) in CONSTANTS.items():
        lines += [f"// {meaning}", f"inline constexpr int {_camel(name)} = {value};"]
    lines += ["", "// Head dims with kernels, per family (the dispatch switches over these).", ""]
    for family, dims in HEAD_DIMS.items():
        camel = _camel(family)[1:]
        lines += [f"using {camel}HeadDims = std::integer_sequence<int, {', '.join(map(str, dims))}>;",
                  f"constexpr bool {family}_supports_head_dim(int d) {{ return {' || '.join(f'd == {d}' for d in dims)}; }}"]
    for family, pairs in HEAD_DIM_PAIRS.items():
        camel = _camel(family)[1:]
        flat = ", ".join(f"{h}, {v}" for h, v in pairs)
        test = " || ".join(f"(h == {h} && v == {v})" for h, v in pairs)
        lines += [f"// (head dim, value head dim) pairs, flattened.",
                  f"using {camel}HeadDims = std::integer_sequence<int, {flat}>;",
                  f"constexpr bool {family}_supports_head_dims(int h, int v) {{ return {test}; }}"]
    lines += ["", "// The launchers' tile shapes that depend on the call (jax_flash/_plan.py picks one).",
              "enum class Tiles : int {"]
    lines += [f"  {_camel(name)} = {value},  // {meaning}" for name, (value, meaning) in TILES.items()]
    lines += ["};", "// Tiles' values are 0 .. kTilesCount - 1.", f"inline constexpr int kTilesCount = {len(TILES)};"]
    lines += ["", "// One segment-chunk summary (jax_flash/_masks.py writes them, common/mask.cuh reads them).",
              f"struct MaskChunk {{", f"  int {', '.join(MASK_CHUNK_FIELDS)};", "};",
              f"inline constexpr int kMaskChunkFields = {len(MASK_CHUNK_FIELDS)};",
              "static_assert(sizeof(MaskChunk) == kMaskChunkFields * sizeof(int));", "",
              "}  // namespace jax_flash::contract", ""]
    return "\n".join(lines)


def contract_module() -> str:
    lines = ['"""Generated by scripts/generate_instantiations.py; do not edit. The kernel contract: what the',
             'kernels (cuda/generated/contract.h, written from the same lists) and this package both assume."""', ""]
    for family, dims in HEAD_DIMS.items():
        lines.append(f"{family.upper()}_HEAD_DIMS = {tuple(dims)!r}")
    for family, pairs in HEAD_DIM_PAIRS.items():
        lines.append(f"{family.upper()}_HEAD_DIMS = {tuple(pairs)!r}  # (head dim, value head dim)")
    lines.append("")
    for name, (value, meaning) in CONSTANTS.items():
        lines.append(f"{name} = {value}  # {meaning}")
    lines += ["", f"MASK_CHUNK_FIELDS = {MASK_CHUNK_FIELDS!r}", "",
              "# The launchers' tile shapes that depend on the call (contract.h's Tiles): name -> value."]
    lines += ["TILES = {"] + [f"    {name!r}: {value},  # {meaning}" for name, (value, meaning) in TILES.items()]
    lines += ["}", ""]
    return "\n".join(lines)


# The lists of families.cmake, in CMakeLists.txt's order: each instantiation file is in one.
FAMILIES = ("hopper", "turing", "mma_sync", "mma_sync_off_hopper")


def family(kernel: str, arch: str, head_dim, variant: str) -> str:
    """Which list of families.cmake an instantiation file is in."""
    if arch == "sm80" and head_dim in HOPPER_HAS_TOO.get(kernel, ()) and variant != "kEverything":
        return "mma_sync_off_hopper"
    return {"sm90": "hopper", "sm75": "turing", "sm80": "mma_sync"}[arch]


def families_cmake(families: dict[str, list[str]]) -> str:
    lines = ["# Generated by scripts/generate_instantiations.py; do not edit. The instantiation files of each",
             "# kernel family, for CMakeLists.txt to compile each for its family's targets: hopper (sm_90a),",
             "# turing (sm_75), mma_sync (sm_80 on, Hopper included) and mma_sync_off_hopper (sm_80 on, where",
             "# Hopper runs its own kernels but for tests that force the mma.sync family)."]
    for name in FAMILIES:
        lines += [f"set(JAX_FLASH_{name.upper()}_SOURCES"] + [f"  {f}" for f in sorted(families[name])] + [")"]
    return "\n".join(lines) + "\n"


def expected_files() -> dict[str, str]:
    files = {"contract.h": contract_header(), "ffi_operands.h": ffi_operands.header()}
    families = {name: [] for name in FAMILIES}
    for (kernel, arch), (header, launcher, params, head_dims, suffixes) in KERNELS.items():
        for dtype in ARCH_DTYPES.get(arch, DTYPES):
            ctype = DTYPES[dtype]
            for head_dim in head_dims:
                # A pair (head dim, value head dim) names both: hdim192v128, template arguments 192, 128.
                dims = f"{head_dim[0]}v{head_dim[1]}" if isinstance(head_dim, tuple) else head_dim
                arguments = ", ".join(map(str, head_dim)) if isinstance(head_dim, tuple) else head_dim
                by_family = {}  # family -> its variants, in VARIANTS' order
                for variant in suffixes.values():
                    by_family.setdefault(family(kernel, arch, head_dim, variant), []).append(variant)
                for name_of_family, variants in by_family.items():
                    # Split only where Hopper runs the bias variant and not the others: "_bias" names it.
                    split = len(by_family) > 1 and variants == ["kEverything"]
                    name = f"{kernel}_{arch}_{dtype}_hdim{dims}{'_bias' if split else ''}.cu"
                    tiles = "jax_flash::contract::Tiles, " if launcher in TAKES_TILES else ""
                    types = [ctype] if kernel not in KV_TYPES else [f"{ctype}, {kv or ctype}" for kv in KV_TYPES[kernel]]
                    files[name] = HEADER.format(header=header) + "".join(
                        INSTANTIATION.format(launcher=launcher, types=t, head_dim=arguments, variant=variant,
                                             params=params, tiles=tiles)
                        for t in types for variant in variants)
                    families[name_of_family].append(name)
    files["families.cmake"] = families_cmake(families)
    return files


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    files = expected_files()
    present = {p.name: p.read_text() for p in OUT.iterdir() if p.suffix in (".cu", ".h", ".cmake")} if OUT.exists() else {}
    modules = {PY_CONTRACT: contract_module(), PY_OPERANDS: ffi_operands.module()}
    if args.check:
        stale = sorted(set(present) ^ set(files) | {n for n in files if present.get(n) != files[n]})
        stale += [str(path.relative_to(ROOT)) for path, text in modules.items()
                  if not path.exists() or path.read_text() != text]
        if stale:
            sys.exit(f"generated files are stale ({', '.join(stale)}): run python scripts/generate_instantiations.py")
        print(f"cuda/generated ({len(files)} files) and {_names(modules)} are current")
        return
    OUT.mkdir(parents=True, exist_ok=True)
    for name in set(present) - set(files):
        (OUT / name).unlink()
    for name, text in files.items():
        (OUT / name).write_text(text)
    for path, text in modules.items():
        path.write_text(text)
    print(f"wrote {len(files)} files to {OUT.relative_to(ROOT)} and {_names(modules)}")


def _names(paths) -> str:
    return ", ".join(str(p.relative_to(ROOT)) for p in paths)


if __name__ == "__main__":
    main()
