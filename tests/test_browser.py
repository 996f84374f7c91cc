"""The browser tests' guard: without a browser a test skips, but under CI (where .ci/run installs one) it fails."""

from __future__ import annotations

import inspect
import os

import pytest
from browser import needs_browser, require_browser


@pytest.fixture
def no_browser(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no chromium on the path


@pytest.fixture
def fake_browser(monkeypatch, tmp_path) -> str:
    path = tmp_path / "chromium"
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    return str(path)


@pytest.mark.usefixtures("no_browser")
@pytest.mark.parametrize("value", ["true", "1", "True"])
def test_under_ci_a_missing_browser_fails_the_test(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception, match=r"^no chromium .*; under CI=true a browser test fails instead"):
        require_browser()


@pytest.mark.usefixtures("no_browser")
@pytest.mark.parametrize("value", [None, "", "false"])
def test_elsewhere_a_missing_browser_skips_the_test(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.skip.Exception, match=r"^no chromium to open the page in \(apt-get install chromium\)$"):
        require_browser()


def test_a_browser_on_the_path_is_the_one_given(monkeypatch, fake_browser):
    monkeypatch.setenv("CI", "true")
    assert require_browser() == fake_browser


def test_the_decorator_checks_before_the_test_runs_and_passes_its_fixtures(monkeypatch, fake_browser):
    ran = []

    @needs_browser
    def opens_a_page(tmp_path, out):
        ran.append((tmp_path, out))

    monkeypatch.setenv("CI", "true")
    assert list(inspect.signature(opens_a_page).parameters) == ["tmp_path", "out"]  # what pytest reads for fixtures
    assert [mark.args for mark in opens_a_page.pytestmark] == [(False,)]  # a browser: no skip
    opens_a_page("t", out="o")
    assert ran == [("t", "o")]
    os.remove(fake_browser)  # now no browser on the path
    with pytest.raises(pytest.fail.Exception):
        opens_a_page("t", out="o")
    assert ran == [("t", "o")]  # the test body did not run


@pytest.mark.usefixtures("no_browser")
@pytest.mark.parametrize("ci, skipped", [(None, True), ("true", False)])
def test_the_decorator_skips_by_a_mark_but_never_under_ci(monkeypatch, ci, skipped):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)

    @needs_browser
    def opens_a_page():
        pass

    [mark] = opens_a_page.pytestmark
    assert mark.name == "skipif" and mark.args == (skipped,)
