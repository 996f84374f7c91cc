"""The environment of a child process a test starts: the parent's, with this checkout first on the import path.

Every test that starts Python (``-c`` code, a script, torchrun) builds its environment here, so the child
imports this checkout's ``ditorch``/``op_tools`` and ``tests/`` helpers, and still finds whatever the parent
finds through its own ``PYTHONPATH`` (packages installed outside site-packages, a CI's extra paths).
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")


def child_env(extra: dict | None = None, *, drop: tuple[str, ...] = (), path: tuple[str, ...] = ()) -> dict:
    """``os.environ`` less the variables starting with a prefix in ``drop``, plus ``extra``; ``PYTHONPATH`` is
    ``path``, the project root and ``tests/``, then the parent's own ``PYTHONPATH`` (kept, never replaced).

    >>> env = child_env({"DITORCH_QUIET": "1"}, drop=("OP_",))
    >>> env["PYTHONPATH"].split(os.pathsep)[:2] == [ROOT, TESTS]
    True
    """
    env = {k: v for k, v in os.environ.items() if not (drop and k.startswith(drop))}
    env.update(extra or {})
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    env["PYTHONPATH"] = os.pathsep.join([*path, ROOT, TESTS, *inherited])
    return env



def env_without_settings(extra: dict | None = None) -> dict:
    """``child_env`` less every variable ditorch and op_tools read (``DITORCH_*``, ``OP_*``, the tolerance and
    reference-dtype families), plus ``extra``: a child that sees only the settings a test gives it."""
    env = child_env(drop=("OP_", "DITORCH_", "AUTOCOMPARE_"))
    env = {k: v for k, v in env.items() if "_AUTOCOMPARE_" not in k and not k.endswith("_OP_DTYPE_CAST_DICT")}
    env.update(extra or {})
    return env


def torchrun_on_sim(*arguments, extra: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=2 ARGUMENTS`` on sim (the parent's ditorch and op_tools settings
    dropped, ``extra`` added), from the project root; its output captured as text. Skips the test on a torch
    older than sim needs."""
    import pytest
    from hardware import sim_missing

    if sim_missing():
        pytest.skip(sim_missing())
    env = child_env({"DITORCH_BACKEND": "sim", "DITORCH_QUIET": "1", "OMP_NUM_THREADS": "1", **(extra or {})},
                    drop=("DITORCH_", "OP_"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               *map(str, arguments)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
