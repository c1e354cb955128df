"""MkDocs hook: every figure on the site opens at full size when clicked.

The benchmark figures are drawn for print (the per-shape speedup chart is
~1900 px wide) and are scaled down to the text column, where their tick
labels are hard to read. This hook wraps each ``<img>`` of a page's content
that shows a file of the site (not an inline ``data:`` image, not one already
inside a link) in a link to that file, so a click shows it at full size.
The browser check (tests/browser/test_site.py) fails on a figure shown at
less than 60 % of its size without such a link.
"""

from __future__ import annotations

import re

_IMG = re.compile(r"<img\b[^>]*>", re.IGNORECASE)
_SRC = re.compile(r"""\bsrc\s*=\s*(["'])(.*?)\1""", re.IGNORECASE | re.DOTALL)
_OPEN_A = re.compile(r"<a\b", re.IGNORECASE)
_CLOSE_A = re.compile(r"</a\s*>", re.IGNORECASE)


def _inside_link(html_text: str, pos: int) -> bool:
    """Whether position ``pos`` lies between an ``<a ...>`` and its ``</a>``."""
    before = html_text[:pos]
    last_open = max((m.start() for m in _OPEN_A.finditer(before)), default=-1)
    last_close = max((m.start() for m in _CLOSE_A.finditer(before)), default=-1)
    return last_open > last_close


def link_figures(page_html: str) -> str:
    """``page_html`` with each local image wrapped in a link to its file."""
    out, last = [], 0
    for match in _IMG.finditer(page_html):
        src = _SRC.search(match[0])
        if not src or src[2].startswith(("data:", "http:", "https:")) or _inside_link(page_html, match.start()):
            continue
        out.append(page_html[last:match.start()])
        out.append(
            f'<a class="figure-link" href="{src[2]}" title="Open the full-size image">{match[0]}</a>'
        )
        last = match.end()
    out.append(page_html[last:])
    return "".join(out)


def on_page_content(page_html, page, config, files):
    return link_figures(page_html)
