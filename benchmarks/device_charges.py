"""What a step charges the host on a real device, counted on sim (``torch.sim.device_counts()``): the benchmarks'
shared helper, so each prints the same columns.

Counts are exact on any machine, so one round of a condition gives them; times are not, so they are medians.
On any other device ``counts()`` returns None and the columns say "-".
"""

from __future__ import annotations

import torch

COLUMNS = ("syncs", "d2h copies", "d2h KiB", "h2d copies", "kernels")
_FIELDS = ("synchronizations", "device_to_host_copies", "device_to_host_bytes", "host_to_device_copies",
           "kernel_launches")


def counts():
    """The sim device's counters now (a ``DeviceCounts``), or None on a device that does not count."""
    sim = getattr(torch, "sim", None)
    return sim.device_counts() if sim is not None and hasattr(sim, "device_counts") else None


def per_step(before, after, steps: int) -> dict[str, float] | None:
    """The counts between two ``counts()`` divided by ``steps``; None where nothing was counted."""
    if before is None or after is None:
        return None
    return (after - before).per(steps)


def header() -> str:
    return "".join(f"{c:>12}" for c in COLUMNS)


def cells(figures: dict[str, float] | None) -> str:
    if figures is None:
        return "".join(f"{'-':>12}" for _ in COLUMNS)
    values = [figures[f] / 1024 if f.endswith("bytes") else figures[f] for f in _FIELDS]
    return "".join(f"{v:>12.1f}" for v in values)


def summary(figures: dict[str, float] | None) -> str:
    """``1.0 syncs, 3 d2h copies (12.0 KiB), 0 h2d, 2,911 kernels per step``, or '' where nothing was counted."""
    if figures is None:
        return ""
    return (f"{figures['synchronizations']:g} syncs, {figures['device_to_host_copies']:g} d2h copies "
            f"({figures['device_to_host_bytes'] / 1024:.1f} KiB), {figures['host_to_device_copies']:g} h2d copies, "
            f"{figures['kernel_launches']:,.0f} kernels per step")
