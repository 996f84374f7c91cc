"""The verdict banner of the HTML pages: fixed at the top while the page scrolls, the verdict as its headline, then
where the first difference or failure is (the fields known: rank, step, phase, module, op, ...), then a line or two.

A page embeds ``BANNER_CSS`` in its style, ``banner(...)`` first in its body and ``BANNER_SCRIPT`` in its script;
its own sticky table headers use ``top: var(--banner-height)`` to sit under the banner, not behind it. Nothing on
load scrolls the page: the banner is the first thing seen, and a button scrolls to the row it names.

>>> text = banner("compare_runs", "The runs diverge", "found", "first divergence",
...               {"rank": None, "step": 0, "phase": "forward", "module": "model.layers.1.mlp.act_fn"}, [])
>>> 'data-field="module"' in text and 'data-field="rank"' not in text
True
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping

TONES = ("found", "unchecked", "clean")  # red, amber, green: the verdict's colour

BANNER_CSS = """
body { margin-top: 0; }
#banner { position: sticky; top: 0; z-index: 10; margin: 0 -1.5em 1em; padding: 0.5em 1.5em 0.6em;
  background: #fff; border-bottom: 1px solid #bbb; box-shadow: 0 2px 4px rgba(0, 0, 0, 0.08); }
#banner .page-title { color: #555; font-size: 12px; }
#banner h1 { margin: 0.1em 0 0.2em; font-size: 22px; line-height: 1.25; }
#banner.verdict-found h1 { color: #a40000; } #banner.verdict-unchecked h1 { color: #8a5a00; }
#banner.verdict-clean h1 { color: #1d6b1d; }
#banner.verdict-found { border-left: 6px solid #c00; } #banner.verdict-unchecked { border-left: 6px solid #e0a000; }
#banner.verdict-clean { border-left: 6px solid #3a3; }
#banner .where { margin: 0.2em 0; } #banner .where-label { font-weight: 600; margin-right: 0.6em; }
/* a long value (a source line, a path) wraps inside its field: shown whole, never wider than the window */
#banner .field { display: inline-block; margin-right: 1em; overflow-wrap: anywhere; }
#banner .field-name { color: #666; margin-right: 0.3em; }
#banner .field code { font-size: 13px; background: #f3f3f3; padding: 0 3px; border-radius: 3px; }
#banner .banner-line { margin: 0.15em 0 0; color: #333; font-size: 12px; overflow-wrap: anywhere; }
#banner button { margin-left: 0.5em; }
"""

# Keeps --banner-height equal to the banner's height (it wraps at narrow widths), for the pages' sticky headers.
BANNER_SCRIPT = """
(function () {
  const banner = document.getElementById("banner");
  const fit = () => document.documentElement.style.setProperty("--banner-height", banner.offsetHeight + "px");
  fit();
  if (window.ResizeObserver) new ResizeObserver(fit).observe(banner);
})();
"""


def banner(title: str, headline: str, tone: str, where_label: str, where: Mapping[str, object],
           lines: Iterable[str], button: str = "") -> str:
    """The banner's HTML: ``title`` (small), ``headline`` (the verdict), ``where_label`` and the ``where`` fields
    whose value is known (not None nor ""), in their order, each ``data-field`` named; ``lines`` below them;
    ``button``: the label of a ``<button id="go-first">`` the page wires to scroll to the row named."""
    if tone not in TONES:
        raise ValueError(f"tone {tone!r}: one of {', '.join(TONES)}")
    fields = "".join(f'<span class="field" data-field="{html.escape(name)}"><span class="field-name">'
                     f"{html.escape(name)}</span><code>{html.escape(str(value))}</code></span>"
                     for name, value in where.items() if value is not None and value != "")
    go = f'<button id="go-first" type="button">{html.escape(button)}</button>' if button and fields else ""
    where_html = (f'<div class="where"><span class="where-label">{html.escape(where_label)}</span>{fields}{go}</div>'
                  if fields else "")
    extra = "".join(f'<p class="banner-line">{html.escape(line)}</p>' for line in lines)
    return (f'<header id="banner" class="verdict-{tone}"><div class="page-title">{html.escape(title)}</div>'
            f'<h1 id="verdict">{html.escape(headline)}</h1>{where_html}{extra}</header>')
