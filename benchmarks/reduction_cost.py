"""What one call's device-side reduction costs the host: the launch OpOverflowCheck makes per checked call.

On a fast device a tool's per-call work is host work: a reduction's kernel takes microseconds, its dispatch and launch
about as long. Times each way of reducing a call's tensors to values that hold an inf or a nan exactly where a tensor
does, ``--calls`` times in a row, on the host (the device keeps up), against one elementwise op for scale: tensors of
a real-size Llama's step (float32 activations of 2x256x512 and 2x256x1408, a transposed weight, a bfloat16
activation, a 0-d loss). On the CPU the times are the kernels' own; the host's share shows on a GPU.

    python benchmarks/reduction_cost.py [--device cuda|cpu|sim] [--calls 2000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("DITORCH_QUIET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

INF = float("inf")


def cases(device: str) -> dict:
    a, b = (torch.randn(2, 256, 512, device=device) for _ in range(2))
    c = torch.randn(2, 256, 1408, device=device)
    w = torch.randn(1408, 512, device=device)
    h = torch.randn(2, 256, 512, device=device, dtype=torch.bfloat16)
    s = torch.randn((), device=device)
    return {
        "one elementwise op (a.add(1)), for scale": lambda: a.add(1),
        "linalg.vector_norm(a, inf)": lambda: torch.linalg.vector_norm(a, INF),
        "aminmax(a)": lambda: torch.aminmax(a),
        "a.abs().max()": lambda: a.abs().max(),
        "_foreach_norm([a], inf)": lambda: torch._foreach_norm([a], INF),
        "_foreach_norm([a, b, c], inf)": lambda: torch._foreach_norm([a, b, c], INF),
        "_foreach_norm([a, w.t(), c], inf): a transposed weight": lambda: torch._foreach_norm([a, w.t(), c], INF),
        "_foreach_norm([a, bf16], inf): two dtypes": lambda: torch._foreach_norm([a, h], INF),
        "_foreach_norm([a, 0-d], inf)": lambda: torch._foreach_norm([a, s], INF),
        "three vector_norm(t, inf)": lambda: [torch.linalg.vector_norm(t, INF) for t in (a, b, c)],
        "stack of three 0-d tensors (the readback's join)": lambda: torch.stack([s, s, s]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    if args.device == "sim":
        import ditorch.sim

        ditorch.sim.register()
    module = getattr(torch, args.device, None)
    synchronize = getattr(module, "synchronize", None) or (lambda: None)
    print(f"torch {torch.__version__}, {args.device}; {args.calls} calls each, host µs a call (the device's too)")
    print(f"{'per call':<58}{'host µs':>9}{'with the device':>17}")
    for name, call in cases(args.device).items():
        for _ in range(min(50, args.calls)):  # warm-up: the allocator's blocks, the kernels' first launch
            call()
        synchronize()
        begin = time.perf_counter()
        for _ in range(args.calls):
            call()
        host = time.perf_counter() - begin
        synchronize()
        both = time.perf_counter() - begin
        print(f"{name:<58}{host / args.calls * 1e6:>9.1f}{both / args.calls * 1e6:>17.1f}")
        print(f"summary: reduction_cost: {args.device}: {name}: {host / args.calls * 1e6:.1f} µs of host a call")


if __name__ == "__main__":
    main()
