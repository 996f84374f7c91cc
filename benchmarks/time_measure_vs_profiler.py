"""OpTimeMeasure's per-op forward time against torch.profiler's kernel time, on a CUDA GPU, side by side.

For each op below, ``--calls`` back-to-back calls are timed three ways in each of ``--rounds`` alternating rounds:
torch.profiler (per call, the sum of the device activities it launched: kernels, memsets, copies), OpTimeMeasure
(timing events on the op's stream, the default) and OpTimeMeasure with ``OP_TIME_MEASURE_SYNC=1`` (a device
synchronisation before and after each call). Printed: the medians over all calls, and each OpTimeMeasure median
over the profiler's. Target: within 10% of the profiler (ratio <= 1.10) for ops of 100 µs or more; a tiny op reads
as its launch latency, which the profiler's kernel time leaves out.

    python benchmarks/time_measure_vs_profiler.py [--calls 20] [--rounds 3] [--ops linear,softmax]

Without a CUDA GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import torch  # noqa: E402
from torch.nn import functional  # noqa: E402

import op_tools  # noqa: E402

TARGET = 1.10  # OpTimeMeasure / profiler, for ops whose kernels take at least MIN_US
MIN_US = 100.0


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device="cuda", dtype=dtype)


# name -> (label, op name as OpTimeMeasure reports it, builder returning (function, args, kwargs))
OPS = {
    "linear": ("linear bf16 8192x4096 @ 4096x4096", "torch.nn.functional.linear",
               lambda: (functional.linear,
                        (_randn(8192, 4096, dtype=torch.bfloat16), _randn(4096, 4096, dtype=torch.bfloat16)), {})),
    "layer_norm": ("layer_norm fp32 16384x4096", "torch.nn.functional.layer_norm",
                   lambda: (functional.layer_norm, (_randn(16384, 4096), (4096,), _randn(4096), _randn(4096)), {})),
    "sdpa": ("causal SDPA bf16 8x16x4096x128", "torch.nn.functional.scaled_dot_product_attention",
             lambda: (functional.scaled_dot_product_attention,
                      tuple(_randn(8, 16, 4096, 128, dtype=torch.bfloat16) for _ in range(3)), {"is_causal": True})),
    "conv2d": ("conv2d fp32 64x256x56x56, 3x3 256", "torch.nn.functional.conv2d",
               lambda: (functional.conv2d, (_randn(64, 256, 56, 56), _randn(256, 256, 3, 3)), {"padding": 1})),
    "matmul": ("matmul fp32 4096x4096", "torch.matmul",
               lambda: (torch.matmul, (_randn(4096, 4096), _randn(4096, 4096)), {})),
    "softmax": ("softmax fp32 16384x4096", "torch.nn.functional.softmax",
                lambda: (functional.softmax, (_randn(16384, 4096),), {"dim": -1})),
    "add": ("add fp32 1024 (about 1 us)", "torch.add", lambda: (torch.add, (_randn(1024), _randn(1024)), {})),
}


def profiler_times(fn, args, kwargs, calls: int) -> list[float]:
    """Device time of each call in µs, from torch.profiler: the device activities in launch order, ``len / calls``
    to a call (every op here launches the same ones each call); the mean when they do not divide evenly."""
    from torch.autograd import DeviceType

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(calls):
            fn(*args, **kwargs)
        torch.cuda.synchronize()
    device_events = sorted((e for e in profile.events() if e.device_type == DeviceType.CUDA),
                           key=lambda e: e.time_range.start)
    durations = [e.time_range.elapsed_us() for e in device_events]
    if not durations:
        raise RuntimeError("torch.profiler recorded no CUDA activity (is CUPTI available?)")
    per_call, rest = divmod(len(durations), calls)
    if rest:
        return [sum(durations) / calls] * calls
    return [sum(durations[i * per_call:(i + 1) * per_call]) for i in range(calls)]


def tool_times(fn, args, kwargs, calls: int, name: str, synchronise: bool) -> list[float]:
    """OpTimeMeasure's forward time of each call in µs."""
    os.environ["OP_TIME_MEASURE_SYNC"] = "1" if synchronise else "0"
    torch.cuda.synchronize()
    with contextlib.redirect_stdout(io.StringIO()), op_tools.OpTimeMeasure() as timer:
        for _ in range(calls):
            fn(*args, **kwargs)
    return [r.forward_ns / 1e3 for r in timer.measurements.records if r.name == name]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="calls per op and way, per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (profiler, events, sync)")
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of " + ", ".join(OPS))
    args = parser.parse_args()
    print("OpTimeMeasure per-op forward time against torch.profiler's kernel time")
    if not torch.cuda.is_available():
        print("skipped: no CUDA GPU (torch.cuda.is_available() is False)")
        return
    results = tempfile.mkdtemp(prefix="time_measure_vs_profiler_")
    os.environ.update(OP_TOOLS_RESULTS_DIR=results, OP_TOOLS_VERBOSE="0")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {args.calls} calls per op and way, "
          f"{args.rounds} alternating rounds, medians over all calls (µs)")
    header = f"{'op':<38}{'profiler':>10}{'events':>10}{'x prof':>8}{'sync':>10}{'x prof':>8}"
    print(header)
    worst = None
    met = checked = 0
    try:
        for key in filter(None, args.ops.split(",")):
            label, name, build = OPS[key]
            fn, op_args, kwargs = build()
            for _ in range(3):  # warm-up: cuBLAS/cuDNN handles and algorithm choice, the allocator
                fn(*op_args, **kwargs)
            samples: dict[str, list[float]] = {"profiler": [], "events": [], "sync": []}
            for _ in range(args.rounds):
                samples["profiler"] += profiler_times(fn, op_args, kwargs, args.calls)
                samples["events"] += tool_times(fn, op_args, kwargs, args.calls, name, synchronise=False)
                samples["sync"] += tool_times(fn, op_args, kwargs, args.calls, name, synchronise=True)
            prof, events, sync = (statistics.median(samples[k]) for k in ("profiler", "events", "sync"))
            print(f"{label:<38}{prof:>10.1f}{events:>10.1f}{events / prof:>8.2f}{sync:>10.1f}{sync / prof:>8.2f}")
            if prof >= MIN_US:
                checked += 1
                met += abs(events / prof - 1) <= TARGET - 1
                if worst is None or abs(events / prof - 1) > abs(worst[0] - 1):
                    worst = (events / prof, key)
            del fn, op_args, kwargs
            torch.cuda.empty_cache()
    finally:
        shutil.rmtree(results, ignore_errors=True)
        os.environ.pop("OP_TIME_MEASURE_SYNC", None)
    if worst is not None:
        print(f"summary: time_measure_vs_profiler: ops of {MIN_US:.0f} us or more within {TARGET - 1:.0%} of "
              f"torch.profiler: {met}/{checked} (worst {worst[1]} {worst[0]:.2f}x)")


if __name__ == "__main__":
    main()
