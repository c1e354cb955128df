"""MkDocs hook: render the notebooks' LaTeX math as MathML when the site is built.

The tutorial notebooks write math as ``$...$`` and ``$$...$$`` in Markdown
cells. nbconvert leaves it as TeX for MathJax, which would have to come from a
CDN; the site loads nothing from outside. Instead this hook converts each
formula to MathML with ``latex2mathml`` (pure Python) at build time, and
browsers render MathML natively. No JavaScript, no network.

Only notebook pages are touched, and only their text: ``<script>``,
``<style>``, ``<pre>``, ``<code>`` and ``<textarea>`` elements (source code and
printed output) are left alone. A formula that ``latex2mathml`` cannot convert
stays as TeX in a ``<code>`` element, and the build reports it at INFO level.
Without ``latex2mathml`` installed the hook does nothing but say so once: the
notebooks still render, with their math as TeX.
"""

from __future__ import annotations

import html
import logging
import re

try:
    from latex2mathml.converter import convert as _to_mathml
except ImportError:  # the docs extra installs it
    _to_mathml = None

log = logging.getLogger("mkdocs.hooks.mathml")

#: Regions whose text is code or printed output, never math.
_PROTECTED = re.compile(
    r"(<(script|style|pre|code|textarea)\b.*?</\2\s*>)", re.DOTALL | re.IGNORECASE
)
#: $$display$$ first, then $inline$ (no space just inside the dollars, as in
#: Pandoc, so prices and shell prompts are not math).
_DISPLAY = re.compile(r"(?<![\\$])\$\$(.+?)(?<!\\)\$\$", re.DOTALL)
_INLINE = re.compile(r"(?<![\\$\w])\$(?![\s$])(.+?)(?<![\s\\$])\$(?![\w$])", re.DOTALL)
_warned_missing = False


def _math(tex: str, display: str, where: str) -> str:
    source = html.unescape(tex).strip()
    try:
        mathml = _to_mathml(source, display=display)
    except Exception as err:  # noqa: BLE001 - any failure: keep the TeX visible
        log.info("%s: could not convert $%s$ to MathML (%s); left as TeX", where, source, err)
        return f"<code class=\"tex\">{html.escape(source)}</code>"
    return mathml


def _convert_text(text: str, where: str) -> str:
    text = _DISPLAY.sub(lambda m: _math(m[1], "block", where), text)
    return _INLINE.sub(lambda m: _math(m[1], "inline", where), text)


def convert_html(page_html: str, where: str = "page") -> str:
    """``page_html`` with every formula outside code regions turned into MathML."""
    parts = _PROTECTED.split(page_html)
    # re.split with two groups yields: text, whole protected match, tag name, text, ...
    out = []
    for i in range(0, len(parts), 3):
        out.append(_convert_text(parts[i], where))
        if i + 1 < len(parts):
            out.append(parts[i + 1])
    return "".join(out)


def _fix_toc(items, where: str) -> None:
    """Inline math in the table of contents' heading titles, as MathML too."""
    for item in items:
        item.title = _INLINE.sub(lambda m: _math(m[1], "inline", where), item.title)
        _fix_toc(item.children, where)


def on_page_content(page_html, page, config, files):
    global _warned_missing
    if not page.file.src_uri.endswith(".ipynb"):
        return page_html
    if _to_mathml is None:
        if not _warned_missing:
            log.info("latex2mathml is not installed: notebook math is shown as TeX")
            _warned_missing = True
        return page_html
    _fix_toc(page.toc.items, page.file.src_uri)
    return convert_html(page_html, page.file.src_uri)
