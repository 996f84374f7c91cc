import os
import subprocess
import sys
import textwrap

import pytest
from subprocess_env import child_env


@pytest.fixture(autouse=True)
def _results_in_tmp(tmp_path, monkeypatch):
    """Every test writes its op_tools results under its own temporary directory."""
    monkeypatch.setenv("OP_TOOLS_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("OP_TOOLS_VERBOSE", "0")
    for name in list(os.environ):
        if name.startswith(("OP_CAPTURE", "OP_OBSERVE", "OP_OVERFLOW", "OP_FALLBACK", "OP_DTYPE_CAST")):
            monkeypatch.delenv(name)


@pytest.fixture
def group(sim, tmp_path):
    """The default process group: one rank on sim (simccl, as `import ditorch` with DITORCH_BACKEND=sim registers
    it), destroyed after the test."""
    import torch.distributed as dist

    from ditorch.sim import distributed

    distributed.register()
    dist.init_process_group("simccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def run_script(tmp_path):
    """``run_script(code, env)``: run ``code`` in a fresh Python (sim registered, ``env`` added) in ``tmp_path``."""
    return lambda code, env: _run_script(code, env, tmp_path)


def _run_script(code: str, env: dict, cwd) -> subprocess.CompletedProcess:
    prelude = "import sys, torch, ditorch.sim, op_tools\nditorch.sim.register()\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=child_env(env), cwd=cwd,
                          capture_output=True, text=True, timeout=120)
