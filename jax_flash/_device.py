"""What the dispatch rules ask about the default GPU: its SM count and its HBM's peak bandwidth."""

from __future__ import annotations

import functools

import jax

# Peak HBM bandwidth by device kind (vendor figures), most specific name first. A device not listed
# counts as an H100 SXM (`hbm_peak` says so).
HBM_PEAKS = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100": 3.35e12}
DEFAULT_HBM = "H100"


@functools.cache
def sm_count() -> int:
    """Streaming multiprocessors of the default GPU (132 on an H100 SXM)."""
    return int(getattr(jax.devices()[0], "core_count", 0) or 132)


def hbm_peak() -> tuple[str, float]:
    """(name, bytes per second) of the default device's HBM peak (HBM_PEAKS)."""
    kind = jax.devices()[0].device_kind
    for name, rate in HBM_PEAKS.items():
        if name in kind:
            return f"{name}: {rate / 1e12:.2f} TB/s", rate
    rate = HBM_PEAKS[DEFAULT_HBM]
    return f"not known for {kind}; the H100 SXM's {rate / 1e12:.2f} TB/s", rate
