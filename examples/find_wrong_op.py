"""Find a wrong operator: the loss drifts on the device, OpAutoCompare names the op, OpFallback fixes it.

The simulated device stands in for a vendor chip with a broken kernel: ``DITORCH_SIM_FAULTS`` makes
its ``gelu`` wrong by 1% (every output element). Run as is, or choose the fault:

    python examples/find_wrong_op.py
    DITORCH_BACKEND=sim DITORCH_SIM_FAULTS="rsqrt:noise=1e-3" python examples/find_wrong_op.py

On a real accelerator, drop the two ``setdefault`` lines below: the same three steps find a real bad op.
The training code addresses the device as ``"cuda"``: ``import ditorch`` maps it onto sim.
"""

import os

os.environ.setdefault("DITORCH_BACKEND", "sim")                  # the simulated device ...
os.environ.setdefault("DITORCH_SIM_FAULTS", "gelu:noise=1e-2")   # ... with a wrong gelu kernel
os.environ.setdefault("OP_TOOLS_VERBOSE", "0")                    # tables of failing calls only

from tiny_model import train  # noqa: E402

import ditorch  # noqa: E402, F401 - maps "cuda" onto the sim device
import op_tools  # noqa: E402


def report(label: str, losses: list[float], reference: list[float]) -> None:
    drift = max(abs(a - b) for a, b in zip(losses, reference))
    print(f"{label:<28} {' '.join(f'{x:.6f}' for x in losses)}   max difference {drift:.1e}")


def main() -> None:
    on_cpu = train("cpu", steps=3)
    report("loss on cpu", on_cpu, on_cpu)
    report("loss on the device", train("cuda", steps=3), on_cpu)

    print("\n--- OpAutoCompare: one step, every op compared with a float64 CPU run ---")
    with op_tools.OpAutoCompare() as compare:
        train("cuda", steps=1)
    if not compare.failures:
        print("no op failed")
        return
    wrong = compare.failures[0]["op"]  # the first failure in execution order is where to look
    print(f"\nwrong op: {wrong} ({compare.failures[0]['phase']}, {compare.failures[0]['location']})")

    print(f"\n--- OpFallback with OP_FALLBACK_LIST={wrong}: that op runs on the CPU ---")
    os.environ["OP_FALLBACK_LIST"] = wrong  # read when the tool starts; the same works from the shell
    with op_tools.OpFallback():
        fixed = train("cuda", steps=3)
    report("loss on the device, fallback", fixed, on_cpu)
    print(f"losses equal to the CPU's: {fixed == on_cpu}")


if __name__ == "__main__":
    main()
