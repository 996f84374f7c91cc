import os
import subprocess
import sys

import pytest
from subprocess_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")


@pytest.fixture(autouse=True)
def _clean_tool_env(tmp_path, monkeypatch):
    """Each test writes under its own results folder, with no tool variable left from the caller's shell."""
    for name in list(os.environ):
        if name.startswith("OP_") or "AUTOCOMPARE" in name or name.endswith("_OP_DTYPE_CAST_DICT"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "0")


def script_env(**extra: str) -> dict:
    return child_env({"DITORCH_QUIET": "1", "OMP_NUM_THREADS": "1", **extra}, drop=("DITORCH_",))


def start_script(name: str, *args: str, **env: str) -> subprocess.Popen:
    """Start ``scripts/<name>`` in a fresh interpreter (text pipes); several can run at once."""
    return subprocess.Popen([sys.executable, os.path.join(SCRIPTS, name), *args], env=script_env(**env), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
