"""A real headless browser for the tests of the HTML pages (Debian's chromium): such a test skips where none is
installed, and fails under CI (``CI=true``), where ``.ci/run`` installs one, so that CI never passes unopened pages."""

from __future__ import annotations

import functools
import html
import json
import os
import re
import shutil
import struct
import subprocess
import zlib

import pytest

ARTEFACTS = "OP_TOOLS_TEST_ARTEFACTS"  # where set, a folder that also keeps the screenshots, to look at after the run
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


def dump_dom(browser: str, page: str, fragment: str, profile: str, extra: tuple[str, ...] = ()) -> str:
    """The page's DOM after its scripts ran, opened at ``page#fragment`` in a headless browser (``extra``: more
    options, ``--window-size=W,H``, ``--screenshot=PATH``)."""
    url = "file://" + os.path.abspath(page) + (f"#{fragment}" if fragment else "")
    result = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                             "--virtual-time-budget=5000", *extra, "--dump-dom", url],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def keep_artefact(path: str) -> None:
    """A copy of ``path`` (a screenshot) in ``$OP_TOOLS_TEST_ARTEFACTS`` where that is set."""
    keep = os.environ.get(ARTEFACTS)
    if keep:
        os.makedirs(keep, exist_ok=True)
        shutil.copy(path, keep)


def top_rows(png: str, count: int) -> list[list[tuple[int, int, int]]]:
    """The RGB pixels of a screenshot's first ``count`` rows (8-bit RGB or RGBA PNG, as chromium writes), read
    without an image library: enough to tell what the window shows at its top."""
    with open(png, "rb") as f:
        blob = f.read()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n", f"{png}: not a PNG"
    at, header, idat = 8, b"", b""
    while at < len(blob):
        length, kind = struct.unpack(">I4s", blob[at:at + 8])
        if kind == b"IHDR":
            header = blob[at + 8:at + 8 + length]
        elif kind == b"IDAT":
            idat += blob[at + 8:at + 8 + length]
        at += 12 + length
    width, _, depth, colour = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and colour in (2, 6), f"{png}: {depth}-bit colour type {colour}"
    size = 3 if colour == 2 else 4
    stride = width * size
    raw = zlib.decompressobj().decompress(idat, (stride + 1) * count)
    rows, above = [], bytearray(stride)
    for r in range(count):
        kind, line = raw[r * (stride + 1)], bytearray(raw[r * (stride + 1) + 1:(r + 1) * (stride + 1)])
        for i in range(stride):  # undo the row's filter (PNG spec, section 9)
            left = line[i - size] if i >= size else 0
            up, corner = above[i], above[i - size] if i >= size else 0
            guess = left + up - corner
            paeth = min((abs(guess - left), 0, left), (abs(guess - up), 1, up), (abs(guess - corner), 2, corner))[2]
            line[i] = (line[i] + (0, left, up, (left + up) // 2, paeth)[kind]) & 0xFF
        rows.append([tuple(line[x:x + 3]) for x in range(0, stride, size)])
        above = line
    return rows



# Runs the probe's body once the page has loaded and settled, and leaves its result in the DOM for the dump.
_PROBE = """<script>
window.addEventListener("load", () => setTimeout(() => {
  const out = document.createElement("pre");
  out.id = "probe"; out.hidden = true;
  try { out.textContent = JSON.stringify((() => { PROBE_BODY })()); }
  catch (e) { out.textContent = JSON.stringify({probe_error: String(e)}); }
  document.body.append(out);
}, 200));
</script>"""


def open_once(browser: str, page: str, screenshot: str, probe: str = "", window: tuple[int, int] = (1400, 1000)
              ) -> tuple[str, dict]:
    """One opening of ``page`` in the headless browser at ``window`` (width, height): its DOM after its scripts ran
    and what ``probe`` measured; a screenshot is written to ``screenshot`` and copied into ``$OP_TOOLS_TEST_ARTEFACTS``
    where that is set.

    ``probe``: the body of a JavaScript function, run 200 ms after the page's load event, for what a DOM cannot
    show (the scroll position, where an element is drawn, what a click changes); what it returns (JSON) is the
    second value. With a probe, the browser opens a copy of the page with the probe added at its end; a probe that
    changes the page puts it back, since the screenshot is taken after it ran."""
    probed = page
    if probe:
        text = open(page, encoding="utf-8").read()
        probed = os.path.splitext(page)[0] + ".probed.html"
        with open(probed, "w", encoding="utf-8") as f:
            f.write(text.replace("</body>", _PROBE.replace("PROBE_BODY", probe) + "</body>"))
    profile = os.path.join(os.path.dirname(os.path.abspath(screenshot)), "browser-profile")
    dom = dump_dom(browser, probed, "", profile, (f"--window-size={window[0]},{window[1]}",
                                                  f"--screenshot={os.path.abspath(screenshot)}"))
    assert os.path.getsize(screenshot) > 0
    keep_artefact(screenshot)
    found = re.search(r'<pre id="probe" hidden="">(.*?)</pre>', dom, re.S)
    measured = json.loads(html.unescape(found.group(1))) if found else {}
    assert "probe_error" not in measured, measured
    return dom, measured
