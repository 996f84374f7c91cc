"""Running the conformance command in a fresh interpreter, and reading what it wrote, for the tests."""

from __future__ import annotations

import os
import subprocess
import sys

from browser import chromium, dump_dom  # noqa: F401 - the conformance tests import them from here

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
SIM = ("--device", "sim", "--setup", "ditorch.sim:register")


def environment(extra: dict | None = None) -> dict:
    """This checkout and the test setups importable; no fault, tolerance or results variable of the caller."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DITORCH_", "OP_TOOLS_")) and "AUTOCOMPARE_ERROR_TOLERANCE" not in k}
    env.update({"PYTHONPATH": os.pathsep.join([ROOT, HERE]), "DITORCH_QUIET": "1", **(extra or {})})
    return env


def command(*args: str) -> list[str]:
    """The command line; its workers forked (``--start-method fork``) unless ``args`` name a start method: the
    conformance tests' modules fork their children from a server that has imported op_db (``children_import``),
    so a forked worker starts at once where a spawned one imports torch and op_db (8 s of CPU)."""
    fork = () if "--start-method" in args else ("--start-method", "fork")
    return [sys.executable, "-m", "op_tools.conformance", *fork, *args]


def start(*args: str, env: dict | None = None, cwd: str) -> subprocess.Popen:
    """The command, started; ``finish`` waits for it."""
    return subprocess.Popen(command(*args), env=environment(env), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen, timeout: float = 240) -> subprocess.CompletedProcess:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"the sweep did not finish in {timeout} s:\n{out[-3000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def run(*args: str, env: dict | None = None, cwd: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """The command, run to its end (``subprocess.run``: forked from the suite's server, tests/forked_python.py)."""
    try:
        return subprocess.run(command(*args), env=environment(env), cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out, err = (x.decode() if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        raise AssertionError(f"the sweep did not finish in {timeout} s:\n{out[-3000:]}\n{err[-3000:]}") from None


def explain(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
