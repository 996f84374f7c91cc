"""OpAutoCompare's sensitivity: the smallest injected fault it finds in one step, per op and dtype, on sim.

For each op (a Llama-sized call: hidden 128, MLP 256, 4 heads of 32, 2 x 64 tokens) and each of bfloat16 and
float16, one forward and backward runs under OpAutoCompare with ``DITORCH_SIM_FAULTS``-style noise on the op's
kernel (every element times ``1 +- noise``, in the op's dtype), for noise 1e-1 down to 1e-4; the table gives the
smallest noise whose forward call failed (''-'': none), and, as a false-alarm check, whether the clean step passed.
``--errors`` prints each run's device error instead.

    python benchmarks/autocompare_sensitivity.py                   # the table in docs/tools/op_autocompare.md
    python benchmarks/autocompare_sensitivity.py --numerics gpu    # sim summing in a GPU's order
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.nn.functional as F  # noqa: N812

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ditorch.sim  # noqa: E402
import op_tools  # noqa: E402

NOISES = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4)
TOKENS, HIDDEN, MLP, HEADS = (2, 64), 128, 256, 4


def _leaf(*shape, dtype, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype).to("sim").requires_grad_()


def silu(dtype):
    x = _leaf(*TOKENS, MLP, dtype=dtype)
    return F.silu(x)


def gelu(dtype):
    x = _leaf(*TOKENS, MLP, dtype=dtype)
    return F.gelu(x)


def mul(dtype):
    gate, up = _leaf(*TOKENS, MLP, dtype=dtype), _leaf(*TOKENS, MLP, dtype=dtype)
    return gate * up


def softmax(dtype):
    scores = _leaf(TOKENS[0], HEADS, TOKENS[1], TOKENS[1], dtype=dtype, scale=3.0)
    return F.softmax(scores, dim=-1)


def layer_norm(dtype):
    x = _leaf(*TOKENS, HIDDEN, dtype=dtype)
    weight, bias = _leaf(HIDDEN, dtype=dtype), _leaf(HIDDEN, dtype=dtype, scale=0.1)
    return F.layer_norm(x, (HIDDEN,), weight, bias)


def linear(dtype):
    x, weight = _leaf(*TOKENS, HIDDEN, dtype=dtype), _leaf(MLP, HIDDEN, dtype=dtype, scale=HIDDEN ** -0.5)
    return F.linear(x, weight)


def sdpa(dtype):
    q, k, v = (_leaf(TOKENS[0], HEADS, TOKENS[1], HIDDEN // HEADS, dtype=dtype) for _ in range(3))
    with ditorch.sim.sdpa_algorithm("chunked", block_size=32):  # a fused kernel, as on a GPU
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# (name, the call, the sim kernel the fault goes into, the op OpAutoCompare names)
CASES = (
    ("silu", silu, "silu", "silu"),
    ("gelu", gelu, "gelu", "gelu"),
    ("mul", mul, "mul", "mul"),
    ("softmax", softmax, "_softmax", "softmax"),
    ("layer_norm", layer_norm, "native_layer_norm", "layer_norm"),
    ("linear", linear, "mm", "linear"),
    ("sdpa", sdpa, "_scaled_dot_product_fused_attention_overrideable", "scaled_dot_product_attention"),
)


def step(call, dtype, fault: str, op: str, numerics: str = "cpu"):
    """One forward and backward under OpAutoCompare: (the op's forward failed, its forward comparison)."""
    torch.manual_seed(0)
    with op_tools.OpAutoCompare() as tool, ditorch.sim.faults(fault), ditorch.sim.numerics(numerics):
        out = call(dtype)
        out.float().square().sum().backward()
    rows = [c for name, _, phase, c, *_ in tool.rows if phase == "forward" and name.endswith(op)]
    failed = any(f["phase"] == "forward" and f["op"].endswith(op) for f in tool.failures)
    return failed, max(rows, key=lambda c: c.device_error)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--errors", action="store_true", help="print each run's device error")
    parser.add_argument("--ops", default=",".join(c[0] for c in CASES))
    parser.add_argument("--numerics", choices=("cpu", "gpu"), default="cpu",
                        help="sim's numerics: the CPU's kernels, or sums and GEMMs in a GPU's order")
    args = parser.parse_args()
    logging.getLogger("op_tools").setLevel(logging.ERROR)  # the tables of failing calls: not wanted here
    ditorch.sim.register()
    dtypes = (torch.bfloat16, torch.float16)
    print(f"| op | {' | '.join(str(d).removeprefix('torch.') for d in dtypes)} | clean step passes |")
    print("|---|" + "---|" * (len(dtypes) + 1))
    for name, call, kernel, op in (c for c in CASES if c[0] in args.ops.split(",")):
        cells, clean = [], []
        for dtype in dtypes:
            clean_failed, clean_error = step(call, dtype, "", op, args.numerics)
            clean.append("yes" if not clean_failed else "NO")
            smallest = None
            for noise in NOISES:
                failed, error = step(call, dtype, f"{kernel}:noise={noise:g}", op, args.numerics)
                if args.errors:
                    print(f"  {name} {dtype} noise={noise:g}: failed={failed} error={error.device_error:.3g} "
                          f"cpu error {error.cpu_error:.3g} (clean {clean_error.device_error:.3g})", file=sys.stderr)
                if failed:
                    smallest = noise
            cells.append("-" if smallest is None else f"{smallest:g}")
        print(f"| {name} | {' | '.join(cells)} | {', '.join(clean)} |", flush=True)


if __name__ == "__main__":
    main()
