r"""MkDocs hook: render the notebooks' LaTeX math as MathML when the site is built.

The tutorial notebooks write math as ``$...$`` and ``$$...$$`` in Markdown
cells. nbconvert leaves it as TeX for MathJax, which would have to come from a
CDN; the site loads nothing from outside. Instead this hook converts each
formula to MathML with ``latex2mathml`` (pure Python) at build time, and
browsers render MathML natively. No JavaScript, no network.

Only notebook pages are touched, and only their text: ``<script>``,
``<style>``, ``<pre>``, ``<code>`` and ``<textarea>`` elements (source code and
printed output) are left alone. A formula that ``latex2mathml`` cannot convert
(it raises, or it copies an unknown command, such as a misspelt ``\frac``, into the
output) stays as TeX in a ``<code>`` element, and the build logs a WARNING:
``mkdocs build --strict`` then fails instead of shipping raw TeX.

Two gaps of ``latex2mathml`` are filled before converting: inside ``\text{}``
(and its relatives) TeX's escaped characters ``\_ \% \# \$`` mean the bare
character, which latex2mathml would copy backslash and all (``n\_splits``);
and its ``aligned``/``gathered`` environments come out as one run of symbols
with the ``&`` markers in it, so they are converted as the equivalent
``split`` (a two-column table: right-aligned, left-aligned) and a one-column
table. The browser check (tests/browser/test_site.py) fails on a backslash, a
stray ``&`` or an ignored line break left in rendered math.

Without ``latex2mathml`` installed the hook says so once, as a WARNING (a
strict build fails; a plain ``mkdocs serve`` still renders the notebooks, with
their math as TeX).
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

#: A text-mode command and its braced argument (one level of nested braces).
_TEXT_ARG = re.compile(
    r"\\(text|textrm|textit|textbf|textsf|texttt|textnormal|mbox)\s*\{((?:[^{}]|\{[^{}]*\})*)\}"
)
#: TeX's escaped specials, which in text mode stand for the character itself.
_TEXT_ESCAPE = re.compile(r"\\([_%#$])")
#: Environments latex2mathml renders wrongly, and what to convert instead.
_ENVIRONMENTS = {
    "aligned": ("split", "split"),
    "gathered": ("array}{c", "array"),
}
_ENV = re.compile(r"\\(begin|end)\{(" + "|".join(_ENVIRONMENTS) + r")\}")


def _env(match: re.Match) -> str:
    begin, end = _ENVIRONMENTS[match[2]]
    return f"\\begin{{{begin}}}" if match[1] == "begin" else f"\\end{{{end}}}"


def _text(match: re.Match) -> str:
    command, argument = match[1], _TEXT_ESCAPE.sub(r"\1", match[2])
    return "\\" + command + "{" + argument + "}"


def prepare(tex: str) -> str:
    """``tex`` rewritten into what latex2mathml converts faithfully."""
    return _ENV.sub(_env, _TEXT_ARG.sub(_text, tex))


#: A TeX command left in converted MathML: latex2mathml copies commands it does not know.
_LEFT_COMMAND = re.compile(r"\\[A-Za-z]+")


def convert_formula(tex: str, display: str = "inline", where: str = "page") -> str:
    """MathML for the formula ``tex`` (``display``: ``"inline"`` or ``"block"``).

    A formula latex2mathml cannot convert, or converts with a TeX command left
    in it, comes back as its TeX in a ``<code class="tex">`` element, and a
    WARNING names the page (``where``) and the formula: a strict build fails.
    """
    source = prepare(html.unescape(tex).strip())
    if _to_mathml is None:
        _say_missing()
        return f"<code class=\"tex\">{html.escape(source)}</code>"
    try:
        mathml = _to_mathml(source, display=display)
    except Exception as err:  # noqa: BLE001 - any failure: keep the TeX visible, and fail a strict build
        problem = f"{type(err).__name__} {err}".strip()
    else:
        left = _LEFT_COMMAND.search(re.sub(r"<[^>]*>", " ", mathml))
        if left is None:
            return mathml
        problem = f"unknown command {left[0]}"
    log.warning("%s: could not convert $%s$ to MathML (%s); left as TeX", where, source, problem)
    return f"<code class=\"tex\">{html.escape(source)}</code>"


def _say_missing() -> None:
    global _warned_missing
    if not _warned_missing:
        log.warning("latex2mathml is not installed (pip install -e '.[docs]'): notebook math would be shown as TeX")
        _warned_missing = True


_math = convert_formula


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


#: A heading of the converted page: its id and its content, up to the anchor link.
_HEADING = re.compile(
    r'<h([1-6])\b[^>]*\bid="([^"]+)"[^>]*>(.*?)(?:<a class="anchor-link"[^>]*>.*?</a>)?\s*</h\1>',
    re.DOTALL,
)


def _flat(items):
    for item in items:
        yield item
        yield from _flat(item.children)


def _fix_toc(toc, page_html: str, where: str) -> None:
    """The table of contents' titles and links as the page's headings have them.

    mkdocs-jupyter makes the entries from the Markdown source: it drops code
    spans ("4. The oracle: `splitkv.testing...`" became "4. The oracle:"),
    so its link misses the heading's id, and it leaves math as TeX. The
    headings of the converted page have all of it right: the entries take
    their titles and ids, in order (or by id, should the counts differ).
    """
    items = list(_flat(toc.items))
    headings = [(m[2], m[3].strip()) for m in _HEADING.finditer(page_html)]
    if len(items) == len(headings):
        for item, (hid, title) in zip(items, headings):
            item.id, item.title = hid, title
        return
    by_id = dict(headings)
    for item in items:
        if item.id in by_id:
            item.title = by_id[item.id]
        else:
            item.title = _INLINE.sub(lambda m: _math(m[1], "inline", where), item.title)


def on_page_content(page_html, page, config, files):
    if not page.file.src_uri.endswith(".ipynb"):
        return page_html
    if _to_mathml is None:
        _say_missing()
        return page_html
    page_html = convert_html(page_html, page.file.src_uri)
    _fix_toc(page.toc, page_html, page.file.src_uri)
    return page_html
