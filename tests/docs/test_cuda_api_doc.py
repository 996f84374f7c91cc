"""docs/device_layer.md's torch.cuda table is generated from ditorch's code and cannot drift from it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from subprocess_env import ROOT, child_env

GENERATOR = os.path.join(ROOT, "scripts", "gen_cuda_api_docs.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gen_cuda_api_docs  # noqa: E402


def _documented_torch() -> str:
    with open(gen_cuda_api_docs.PAGE) as f:
        return re.search(r"Generated with torch (\S+):", f.read()).group(1)


def test_committed_table_is_what_the_generator_writes_from_the_code():
    documented, running = _documented_torch(), torch.__version__.split("+")[0]
    if documented != running:
        pytest.skip(f"the table lists torch {documented}'s torch.cuda names; this is torch {running}")
    process = subprocess.run([sys.executable, GENERATOR, "--check"], cwd=ROOT, env=child_env(), capture_output=True,
                             text=True, timeout=120)
    assert process.returncode == 0, process.stdout[-4000:] + process.stderr[-2000:]


def test_a_fallback_added_to_the_code_but_not_the_docs_fails_the_check(tmp_path, monkeypatch, capsys):
    from ditorch import cuda_fallbacks

    page = tmp_path / "device_layer.md"
    page.write_text(f"# page\n{gen_cuda_api_docs.BEGIN}\n{gen_cuda_api_docs.END}\ntail\n")
    assert gen_cuda_api_docs.main(["--output", str(page)]) == 0
    assert gen_cuda_api_docs.main(["--check", "--output", str(page)]) == 0
    assert page.read_text().endswith("tail\n") and "| `nvtx.range_push` | mapped |" in page.read_text()

    monkeypatch.setitem(cuda_fallbacks.FALLBACKS, "current_blas_handle",
                        cuda_fallbacks.Fallback(lambda backend, name: lambda: None, what="a handle of nothing"))
    assert gen_cuda_api_docs.main(["--check", "--output", str(page)]) == 1
    assert "+| `current_blas_handle` | mapped | mapped |" in capsys.readouterr().out
