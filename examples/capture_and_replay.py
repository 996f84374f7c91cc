"""Capture one op during training, then replay it offline, alone, with its real inputs.

OpCapture saves the inputs, outputs and gradients of the ops in ``OP_CAPTURE_LIST`` (here ``gelu``);
``op_tools/run_op_from_data.py`` reruns them on this machine's device, checks them against a float64
CPU run and times them. This is how a wrong or slow op goes to a kernel engineer: the folder is the
reproduction.

    python examples/capture_and_replay.py
    DITORCH_BACKEND=sim DITORCH_SIM_FAULTS="gelu:noise=1e-2" python examples/capture_and_replay.py   # replay fails

On an accelerator ditorch finds, capture and replay run there.
"""

import os
import subprocess
import sys

os.environ.setdefault("OP_CAPTURE_LIST", "torch.nn.functional.gelu")  # capture this op only
os.environ.setdefault("OP_TOOLS_VERBOSE", "0")                         # no table per captured call

from tiny_model import pick_device, train  # noqa: E402

import ditorch  # noqa: E402, F401 - maps "cuda" onto the detected device
import op_tools  # noqa: E402


def main() -> None:
    device = pick_device()
    with op_tools.OpCapture():
        train(device, steps=1)

    results = os.environ.get("OP_TOOLS_RESULTS_DIR", "op_tools_results")
    op = os.environ["OP_CAPTURE_LIST"].split(",")[0]
    captured = os.path.join(results, "op_capture_results", op, str(os.getpid()))  # <op>/<pid>/<forward_id>/<time>
    files = sorted(os.path.relpath(os.path.join(d, f), captured) for d, _, fs in os.walk(captured) for f in fs)
    print(f"captured {len(files)} files under {captured}:")
    for name in files:
        print(f"  {name}")

    replay = [sys.executable, "-m", "op_tools.run_op_from_data", captured,
              "--acc_check", "--sync_time_measure", "--run_times", "3"]
    env = dict(os.environ)
    if device == "sim":
        env["DITORCH_BACKEND"] = "sim"  # replay where the capture ran (the variable also maps "cuda" onto sim)
    print("\n$ python " + " ".join(replay[1:]), flush=True)
    status = subprocess.run(replay, env=env).returncode  # the replay prints its own tables
    meaning = {0: "every call ok", 3: "a call mismatched or raised", 4: "a call could not be checked"}
    print(f"\nreplay exit status: {status} ({meaning.get(status, 'the replay failed')})")
    sys.exit(status)


if __name__ == "__main__":
    main()
