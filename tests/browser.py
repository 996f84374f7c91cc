"""A real headless browser for the tests of the HTML pages (Debian's chromium), when one is installed."""

from __future__ import annotations

import os
import shutil
import subprocess


def chromium() -> str | None:
    """The headless browser the HTML tests drive (Debian's package: apt-get install chromium), if any."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def dump_dom(browser: str, page: str, fragment: str, profile: str) -> str:
    """The page's DOM after its scripts ran, opened at ``page#fragment`` in a headless browser."""
    url = "file://" + os.path.abspath(page) + (f"#{fragment}" if fragment else "")
    result = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                             "--virtual-time-budget=5000", "--dump-dom", url],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout
