"""Where a step's host time goes: the calling thread's functions (cProfile), and every thread's CPU time.

cProfile sees the thread that enabled it only. On a GPU, autograd runs backward (the tools' backward hooks) on a
thread of its own per device, and the tools write their files on theirs: their share shows in the CPU time each of
the process's threads spent meanwhile, read from ``/proc/self/task`` (Linux; named as the system names them: PyTorch
names autograd's ``pt_autograd_<device>``). A sampler of every thread's Python stack was tried first and dropped: a
sample waits for the interpreter's lock, which a thread gives up at function entries and at calls that release it,
so the samples piled up on the functions called most often (a 0.8 us lookup was "12% of the step").

    with HostProfile() as profile:
        train(steps=5)
    print(profile.report(top=40))
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import time

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu_seconds() -> dict[int, tuple[str, float]]:
    """``{thread id: (name, user + system CPU seconds)}`` of this process's threads; {} where ``/proc`` has none."""
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / _TICKS)  # utime, stime: fields 14 and 15
    return out


class HostProfile:
    """cProfile of the calling thread and the CPU time of every thread while the ``with`` block runs."""

    def __init__(self) -> None:
        self._profile = cProfile.Profile()
        self.seconds = 0.0
        self.threads: list[tuple[str, int, float]] = []  # (name, thread id, CPU seconds), most first

    def __enter__(self) -> HostProfile:
        self._cpu = thread_cpu_seconds()
        self._begin = time.perf_counter()
        self._profile.enable()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.disable()
        self.seconds = time.perf_counter() - self._begin
        after = thread_cpu_seconds()
        self.threads = sorted(((name, tid, cpu - self._cpu.get(tid, (name, 0.0))[1])
                               for tid, (name, cpu) in after.items()), key=lambda t: -t[2])

    def report(self, top: int = 40) -> str:
        """Every thread's CPU seconds meanwhile, then the calling thread's ``top`` functions by own time and by
        cumulative time (cProfile's times: its own cost inflates small functions)."""
        lines = [f"{self.seconds:.3f} s of wall time; CPU seconds per thread (/proc, {_TICKS} ticks a second):"]
        lines += [f"  {cpu:8.3f}  {name} ({tid})" for name, tid, cpu in self.threads if cpu > 0] or ["  (no /proc)"]
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(self._profile, stream=text).sort_stats(order).print_stats(top)
            lines += ["", f"== the calling thread, by {order}", text.getvalue().strip()]
        return "\n".join(lines) + "\n"
