"""The import contracts (scripts/check_imports.py, run by ``make lint``) hold on the tree, and each one fails on a
deliberate violation written into a copy of it: a circle, one package importing the other, offline code reaching
the engine, an import from a lower layer of op_tools up to a higher one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = os.path.join(ROOT, "scripts", "check_imports.py")


def _check(root: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, CHECK, root], capture_output=True, text=True, timeout=120)


@pytest.fixture
def tree(tmp_path):
    """A copy of both packages' sources, to write violations into."""
    for package in ("ditorch", "op_tools"):
        shutil.copytree(os.path.join(ROOT, package), tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return tmp_path


def _append(path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n\n" + text + "\n")


def test_the_tree_keeps_every_import_contract():
    done = _check(ROOT)
    assert done.returncode == 0, done.stdout


@pytest.mark.parametrize(("file", "violation", "reported"), [
    # an import deferred into a function still closes a circle
    ("op_tools/config/variables.py", "def _late():\n    from ..core import engine", "import circle in op_tools: "),
    ("ditorch/patches.py", "def _late():\n    from . import transfer", "import circle in ditorch: "),
    ("ditorch/env.py", "import op_tools", "ditorch.env imports op_tools"),
    ("op_tools/output/reporting.py", "import ditorch.sim", "op_tools.output.reporting imports ditorch.sim"),
    ("op_tools/offline/compare_runs/report.py", "def _late():\n    from ...tools.autocompare import OpAutoCompare",
     "offline code reaches the engine or a tool: op_tools.offline.compare_runs.report -> op_tools.tools.autocompare"),
    # through another module: error_statistics is lower than both, and now reaches the engine
    ("op_tools/numerics/error_statistics.py", "def _late():\n    from ..core import engine",
     "offline code reaches the engine or a tool: "),
], ids=["circle-op_tools", "circle-ditorch", "ditorch-imports-op_tools", "op_tools-imports-ditorch",
        "offline-imports-a-tool", "offline-reaches-the-engine-through-a-lower-module"])
def test_each_contract_fails_on_a_deliberate_violation(tree, file, violation, reported):
    _append(tree / file, violation)
    done = _check(str(tree))
    assert done.returncode == 1, done.stdout
    assert reported in done.stdout


@pytest.mark.parametrize(("file", "violation", "reported"), [
    # a function-level import counts: ops is the lowest layer
    ("op_tools/ops/naming.py", "def _late():\n    from ..output import reporting",
     "op_tools.ops.naming imports op_tools.output.reporting"),
    ("op_tools/numerics/tensor_stats.py", "from ..config import variables", "layer numerics is below layer config"),
    ("op_tools/core/targeting.py", "from ..offline import replay", "layers core and offline are side by side"),
    ("op_tools/tools/observe.py", "def _late():\n    import op_tools", "layer tools is below the package's face"),
], ids=["ops-imports-output", "numerics-imports-config", "core-imports-offline", "tool-imports-the-package"])
def test_the_layer_contract_fails_on_an_upward_import(tree, file, violation, reported):
    _append(tree / file, violation)
    done = _check(str(tree))
    assert done.returncode == 1, done.stdout
    assert reported in done.stdout, done.stdout


def test_imports_that_never_run_or_may_fail_are_not_violations(tree):
    _append(tree / "op_tools" / "config" / "variables.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                             "    from ..core.engine import OpTool")
    _append(tree / "op_tools" / "output" / "reporting.py",
            "try:\n    import ditorch\nexcept ImportError:\n    ditorch = None")
    done = _check(str(tree))
    assert done.returncode == 0, done.stdout
