"""when_imported runs an action on a module once its code has run, so that a by-name import sees what it did."""

from __future__ import annotations

import sys

import pytest

from ditorch.after_import import when_imported


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A fresh package ``watched_pkg`` with ``defs`` (defines ``f``) and ``user`` (``from .defs import f``)."""
    root = tmp_path / "watched_pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "defs.py").write_text("def f():\n    return 'original'\n")
    (root / "user.py").write_text("from .defs import f\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "watched_pkg"
    for name in [m for m in sys.modules if m.startswith("watched_pkg")]:
        del sys.modules[name]


def test_actions_run_in_order_after_the_module_code_and_by_name_imports_see_them(package):
    seen = []
    when_imported(f"{package}.defs", lambda module: seen.append(("first", module.f())))
    when_imported(f"{package}.defs", lambda module: setattr(module, "f", lambda: "patched"))
    assert seen == [] and f"{package}.defs" not in sys.modules
    user = __import__(f"{package}.user", fromlist=["f"])
    assert seen == [("first", "original")] and user.f() == "patched"


def test_a_module_already_imported_is_acted_on_at_once_and_a_cancelled_action_never_runs(package):
    seen = []
    cancel = when_imported(f"{package}.defs", seen.append)
    cancel()
    defs = __import__(f"{package}.defs", fromlist=["f"])
    assert seen == [] and not any(getattr(f, "name", None) == f"{package}.defs" for f in sys.meta_path)
    when_imported(f"{package}.defs", seen.append)
    assert seen == [defs]
