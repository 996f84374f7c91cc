"""One tool on one function, only for the calls whose arguments meet a condition: ``op_tools.apply_feature``.

Here OpObserve (feature ``dump_op_args``) shows the arguments of ``torch.nn.functional.linear`` only
for the calls whose input has more than 64 features (the MLP's down projection, 128 -> 64); the
other linear calls of the model run untouched. The condition gets the call's own arguments. Then ``fallback``
runs ``gelu`` on the CPU, but only for float32 inputs:

    python examples/apply_feature_condition.py

Features: ``op_capture``, ``dump_op_args``, ``autocompare``, ``measure_op_time``, ``overflow_check``,
``fallback``, ``cast_dtype`` (``op_tools.FEATURES``). ``remove_feature`` puts the functions back.
"""

import collections
import logging

import torch
from tiny_model import pick_device, train

import ditorch  # noqa: F401 - maps "cuda" onto the detected device
import op_tools

seen = collections.Counter()


def wide_input(input, weight, bias=None):  # F.linear's own argument names
    """The condition: called with linear's arguments; true for the calls the feature handles."""
    matched = input.shape[-1] > 64
    seen["matched" if matched else "skipped"] += 1
    return matched


def main() -> None:
    device = pick_device()
    logging.getLogger("op_tools").setLevel(logging.DEBUG)  # the per-call tables, as OP_TOOLS_VERBOSE=1 would
    op_tools.apply_feature("torch.nn.functional.linear", "dump_op_args", condition_func=wide_input)
    op_tools.apply_feature(torch.nn.functional.gelu, "fallback",
                           condition_func=lambda input, approximate="none": input.dtype == torch.float32)
    try:
        losses = train(device, steps=1)
    finally:
        op_tools.remove_feature()  # every patched function restored
    print(f"\nlinear calls: {seen['matched']} printed (input wider than 64), {seen['skipped']} not; "
          f"loss {losses[0]:.6f}")


if __name__ == "__main__":
    main()
