"""docs/env_variables.md is generated from the code's declarations and cannot drift from them."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GENERATOR = os.path.join(ROOT, "scripts", "gen_env_docs.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gen_env_docs  # noqa: E402


def test_committed_page_is_what_the_generator_writes_from_the_code():
    process = subprocess.run([sys.executable, GENERATOR, "--check"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
    assert process.returncode == 0, process.stdout[-4000:] + process.stderr[-2000:]


def _page(tmp_path, text: str):
    page = tmp_path / "env_variables.md"
    page.write_text(text)
    return str(page)


@pytest.mark.parametrize("module", ["op_tools.config.variables", "ditorch.env"])
def test_a_variable_added_to_the_code_but_not_the_docs_fails_the_check(module, tmp_path, monkeypatch, capsys):
    page = _page(tmp_path, gen_env_docs.render())
    assert gen_env_docs.main(["--check", "--output", page]) == 0

    variables = sys.modules[module].VARIABLES
    template = next(iter(variables.values()))
    added = dataclasses.replace(template, name="DITORCH_OR_OP_NEW_KNOB", meaning="A knob added to the code.")
    monkeypatch.setitem(variables, added.name, added)
    assert gen_env_docs.main(["--check", "--output", page]) == 1
    assert "+| " in capsys.readouterr().out  # the diff shows the missing row
    assert gen_env_docs.main(["--output", page]) == 0  # regenerating fixes it
    assert "`DITORCH_OR_OP_NEW_KNOB`" in open(page).read()


def test_every_declared_variable_has_a_row_with_its_default():
    # In a fresh interpreter: the library's own declarations, without the list variables a tool class defined by
    # another test declares in this process (tests/op_tools/test_targeting.py's OP_RECORD).
    code = ("import json, op_tools; from ditorch import env; print(json.dumps([(v.name, v.default) for v in "
            "[*env.VARIABLES.values(), *op_tools.VARIABLES.values()]]))")
    process = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr[-2000:]
    rows = {}
    for line in open(gen_env_docs.PAGE).read().splitlines():
        found = re.search(r"\| `([^`]+)` \|", line)
        if found:
            rows[found.group(1)] = line
    declared = json.loads(process.stdout.splitlines()[-1])
    assert [name for name, _ in declared if name not in rows] == []
    for name, default in declared:
        assert gen_env_docs.code(default) in rows[name], name


def test_every_variable_the_library_reads_by_name_is_declared():
    import op_tools
    from ditorch import env

    declared = set(env.VARIABLES) | set(op_tools.VARIABLES) | set(gen_env_docs.LAUNCHER_VARIABLES)
    read = re.compile(r"""(?:environ(?:\.get)?\(\s*|environ\[\s*|getenv\(\s*|)["']([A-Z][A-Z0-9_]{2,})["']"""
                      r"""(?:\s*\]|\s*[,)]|\s+in\s+(?:os\.)?environ)""")
    found = {}
    for package in ("ditorch", "op_tools"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    source = open(path).read()
                    for line in source.splitlines():
                        if "environ" in line or "getenv" in line:
                            for match in read.finditer(line):
                                found.setdefault(match.group(1), os.path.relpath(path, ROOT))
    undeclared = {name: where for name, where in found.items() if name not in declared}
    assert not undeclared, f"read from the environment but not declared (so not in the docs): {undeclared}"
