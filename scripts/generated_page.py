"""What the doc generators share: write a generated page, or check that the committed one matches."""

from __future__ import annotations

import difflib
import sys


def write_or_check(path: str, current: str, text: str, check: bool, script: str) -> int:
    """With ``check``, exit status 1 and a diff when ``current`` (the page as committed) is not ``text``;
    otherwise write ``text`` to ``path``."""
    if check:
        if current == text:
            return 0
        sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), text.splitlines(True), path,
                                                   "generated from the code"))
        print(f"\n{path} is out of date: run python {script}")
        return 1
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}")
    return 0
