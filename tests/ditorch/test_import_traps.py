"""The traps a new user fell into, each now an error at `import ditorch` that says what to do: a clone named ditorch
beside the script (an empty namespace package before), a misspelt variable that chooses the device (a warning, then
a run on the CPU that crashed on CUDA)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from subprocess_env import ROOT, env_without_settings

from ditorch.env import unknown_variables

BESIDE = "import ditorch\nprint('imported', ditorch.__file__, ditorch.backend.name)\n"


def _clone_beside_a_script(tmp_path) -> tuple[str, str]:
    """``tmp_path/ditorch``: this repository under the name a clone gets; ``tmp_path/train.py`` beside it."""
    clone = tmp_path / "ditorch"
    os.symlink(ROOT, clone, target_is_directory=True)
    (tmp_path / "train.py").write_text(BESIDE)
    return str(clone), str(tmp_path / "train.py")


def _environment(**extra: str) -> dict:
    """The parent's environment without a PYTHONPATH (child_env's adds this checkout) nor ditorch's settings."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("DITORCH_")}
    return {**env, **extra}


def test_a_clone_named_ditorch_beside_the_script_fails_at_once_saying_what_to_do(tmp_path):
    clone, script = _clone_beside_a_script(tmp_path)
    # -S: no site-packages, so no `pip install -e` of this checkout either: a Python where ditorch is not installed
    done = subprocess.run([sys.executable, "-S", script], cwd=tmp_path, env=_environment(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    assert "imported" not in done.stdout
    assert done.stderr.splitlines()[-1] == (
        f"ImportError: import ditorch found {clone}, a clone of the ditorch repository, not the ditorch package (its "
        f"ditorch/ folder), and no ditorch is installed: install it with `pip install -e {clone}`, or run your "
        "script from a folder that does not hold the clone."), done.stderr


def test_a_clone_beside_the_script_hands_the_import_to_an_installed_ditorch(tmp_path):
    _, script = _clone_beside_a_script(tmp_path)
    # ROOT on PYTHONPATH stands for an install further along the import path than the script's folder
    done = subprocess.run([sys.executable, script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=_environment(PYTHONPATH=ROOT, DITORCH_BACKEND="cpu", DITORCH_QUIET="1"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["imported", os.path.join(ROOT, "ditorch", "__init__.py"), "cpu"]


def test_the_root_imported_under_its_folder_name_does_nothing():
    # what pytest does with the root's __init__.py (a package named after the checkout's folder)
    spec = importlib.util.spec_from_file_location("checkout_folder", os.path.join(ROOT, "__init__.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert [name for name in vars(module) if not name.startswith("__")] == ["importlib", "os", "sys"]


@pytest.mark.parametrize("wrong, right, value", [("DITORCH_BACKNED", "DITORCH_BACKEND", "sim"),
                                                 ("DITORCH_SIM_DEVICE_CONT", "DITORCH_SIM_DEVICE_COUNT", "2")])
def test_a_misspelt_variable_that_chooses_the_device_fails_the_import_naming_the_right_one(wrong, right, value):
    done = subprocess.run([sys.executable, "-c", "import torch, ditorch; print(ditorch.backend.name)"],
                          env=env_without_settings({wrong: value}), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stdout == ""
    assert done.stderr.splitlines()[-1] == (
        f"ValueError: {wrong} is not a variable ditorch reads; did you mean {right}? Ignored, the run would go on "
        f"without it, on devices other than those it asks for: set {right}={value} instead, or unset {wrong}.")


def test_other_misspelt_variables_stay_warnings():
    assert unknown_variables({"DITORCH_QUITE": "1", "DITORCH_DISABLE_MOKC": "1"}) == [
        "DITORCH_DISABLE_MOKC is not a variable ditorch reads; did you mean DITORCH_DISABLE_MOCK?",
        "DITORCH_QUITE is not a variable ditorch reads; did you mean DITORCH_QUIET?"]
    # beside the right one, the misspelt one chooses nothing: a warning
    assert unknown_variables({"DITORCH_BACKEND": "sim", "DITORCH_BACKNED": "sim"}) == [
        "DITORCH_BACKNED is not a variable ditorch reads; did you mean DITORCH_BACKEND?"]
