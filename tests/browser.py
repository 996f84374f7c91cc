"""A real headless browser for the tests of the HTML pages (Debian's chromium): such a test skips where none is
installed, and fails under CI (``CI=true``), where ``.ci/run`` installs one, so that CI never passes unopened pages."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

import pytest

MISSING = "no chromium to open the page in (apt-get install chromium)"


def chromium() -> str | None:
    """The headless browser the HTML tests drive (Debian's package: apt-get install chromium), if any."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def under_ci() -> bool:
    """``CI=true`` (or 1, yes): set by CI services, and by ``.ci/run``."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require_browser() -> str:
    """The browser, for a test about to open a page; without one the test skips, or fails under CI."""
    browser = chromium()
    if browser is None:
        if under_ci():
            pytest.fail(f"{MISSING}; under CI=true a browser test fails instead of skipping", pytrace=False)
        pytest.skip(MISSING)
    return browser


def needs_browser(test):
    """Decorator: ``require_browser()`` before the test runs (its fixtures passed through); a skip where no browser
    is found and CI is unset is a mark, so that pytest reports it at the test."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        require_browser()
        return test(*args, **kwargs)

    return pytest.mark.skipif(chromium() is None and not under_ci(), reason=MISSING)(run)


def dump_dom(browser: str, page: str, fragment: str, profile: str) -> str:
    """The page's DOM after its scripts ran, opened at ``page#fragment`` in a headless browser."""
    url = "file://" + os.path.abspath(page) + (f"#{fragment}" if fragment else "")
    result = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                             "--virtual-time-budget=5000", "--dump-dom", url],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout
