"""The build's lists, read from the files CMakeLists.txt reads: the portable targets, and which
kernel family each instantiation file is compiled as (cuda/generated/families.cmake)."""

import pathlib
import re

from jax_flash import _ffi

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_portable_targets_are_cmakes():
    """_ffi.PORTABLE_BUILT_ARCHS is CMakeLists.txt's portable list (built without a GPU to read)."""
    cmake = (ROOT / "CMakeLists.txt").read_text()
    portable = re.search(r'set\(JAX_FLASH_PORTABLE_ARCHS "([^"]+)"\)', cmake).group(1)
    assert tuple(portable.split(";")) == _ffi.PORTABLE_BUILT_ARCHS


def _families() -> dict[str, list[str]]:
    text = (ROOT / "cuda" / "generated" / "families.cmake").read_text()
    return {name.lower(): files.split() for name, files in re.findall(r"set\(JAX_FLASH_(\w+)_SOURCES(.*?)\)", text, re.S)}


def test_every_instantiation_file_is_in_one_family():
    families = _families()
    listed = [name for files in families.values() for name in files]
    generated = sorted(p.name for p in (ROOT / "cuda" / "generated").glob("*.cu"))
    assert sorted(listed) == generated and len(set(listed)) == len(listed)
    assert set(families) == {"hopper", "turing", "mma_sync", "mma_sync_off_hopper"}


def test_the_mma_sync_files_left_to_hopper_have_hopper_kernels():
    """An mma.sync file whose sm_90a code is built only for tests (mma_sync_off_hopper) has a
    Hopper kernel of the same kind, type, head dim and variant, which a Hopper GPU runs instead;
    the mma.sync files it keeps (decode, head dims 32 and 96, a bias) have none, or one that
    dispatch.cu leaves some of its calls (a bias of an odd or strided layout)."""
    families = _families()
    hopper = set(families["hopper"])
    for name in families["mma_sync_off_hopper"]:
        assert "_bias" not in name and name.replace("_sm80_", "_sm90_") in hopper, name
    for name in families["mma_sync"]:
        assert name.startswith("decode_") or "_bias" in name or name.replace("_sm80_", "_sm90_") not in hopper, name
