"""Griffe extension: render the package's Sphinx-style roles as API links.

The splitkv docstrings are Google style but cross-reference with Sphinx roles
(:func:`choose_n_splits`, :class:`~splitkv.testing.VerifyProblem`,
:mod:`splitkv.merge`, :data:`MODEL_SHAPES`). mkdocstrings does not know those
roles, so this extension rewrites each one, before the docstring is parsed,
into an *optional* autorefs link: a link where the target is documented on
the site, plain code where it is not (no broken-link warning either way).

It also turns reST's literal-block marker (a paragraph ending in ``::``) into
a plain colon: the indented block after it is already a Markdown code block;
it splits an ``Args:`` entry that documents several parameters at once
(``k_scale, v_scale: ...``, possibly wrapped over lines) into one entry per
parameter, which is what Google-style parsers expect; and it reads the
Sphinx-style ``#:`` comments above (or after) a constant or attribute as that
attribute's docstring, as Sphinx autodoc does.
"""

from __future__ import annotations

import html
import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|meth|class|mod|data|attr|obj|exc|const):`(?P<target>[^`]+)`")
_LITERAL_MARKER = re.compile(r"(?<=\S)::(?=\n\s*\n)")


def _identifier(obj: griffe.Object, name: str) -> str:
    """Absolute dotted path of ``name`` as seen from ``obj``'s module."""
    if name.startswith("splitkv.") or name == "splitkv":
        return name
    module = obj.module
    first, _, rest = name.partition(".")
    member = module.members.get(first)
    if member is None:
        # Names in the package's top-level docstring and in its submodules
        # mostly mean the public names re-exported by `splitkv`.
        return f"splitkv.{name}"
    base = member.target_path if member.is_alias else member.path
    return f"{base}.{rest}" if rest else base


_ARGS_HEADER = re.compile(r"^(?P<indent>\s*)(?:Args|Arguments|Parameters|Keyword Args|Other Parameters):\s*$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _split_grouped_args(text: str) -> str:
    """``a, b: description`` in an Args section -> one entry for ``a``, one for ``b``."""
    lines = text.split("\n")
    out = []
    i = 0
    while i < len(lines):
        header = _ARGS_HEADER.match(lines[i])
        out.append(lines[i])
        i += 1
        if not header:
            continue
        section = len(header["indent"])
        entry = None  # indent of the section's entries
        while i < len(lines):
            line = lines[i]
            if line.strip() and _indent(line) <= section:
                break  # the section ended
            if not line.strip() or (entry is not None and _indent(line) > entry):
                out.append(line)  # blank line or continuation of an entry
                i += 1
                continue
            entry = _indent(line)
            head = line.strip()
            i += 1
            # A list of names wrapped over lines: join until the colon.
            while ":" not in head and head.endswith(",") and i < len(lines):
                head += " " + lines[i].strip()
                i += 1
            body = []
            while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > entry):
                if not lines[i].strip() and (i + 1 >= len(lines) or _indent(lines[i + 1]) <= entry):
                    break
                body.append(lines[i])
                i += 1
            names, sep, description = head.partition(":")
            if sep and "," in names and "(" not in names:
                for name in (n.strip() for n in names.split(",")):
                    out.append(" " * entry + f"{name}:{description}")
                    out.extend(body)
            else:
                out.append(" " * entry + head)
                out.extend(body)
    return "\n".join(out)


def _rewrite(obj: griffe.Object, text: str) -> str:
    def link(match: re.Match) -> str:
        target = match["target"].strip()
        short = target.startswith("~")
        target = target.lstrip("~").removesuffix("()")
        title = target.rsplit(".", 1)[-1] if short else target
        ident = html.escape(_identifier(obj, target), quote=True)
        return f'<autoref identifier="{ident}" optional><code>{html.escape(title)}</code></autoref>'

    text = _ROLE.sub(link, text)
    text = _split_grouped_args(text)
    return _LITERAL_MARKER.sub(":", text)


def _doc_comment(obj: griffe.Object) -> str | None:
    """The ``#:`` comment lines just above ``obj``'s assignment, or after it on its line."""
    if obj.lineno is None or obj.filepath is None:
        return None
    try:
        lines = obj.lines_collection[obj.filepath]
    except (KeyError, TypeError):
        return None
    first = obj.lineno - 1  # 0-based index of the assignment line
    if not 0 <= first < len(lines):
        return None
    comment = []
    i = first - 1
    while i >= 0 and lines[i].strip().startswith("#:"):
        comment.insert(0, lines[i].strip()[2:].strip())
        i -= 1
    if not comment and "#:" in lines[first]:
        comment = [lines[first].split("#:", 1)[1].strip()]
    return "\n".join(comment) or None


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles in every docstring of the loaded package."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.is_attribute and (obj.docstring is None or not obj.docstring.value):
            text = _doc_comment(obj)
            if text:
                obj.docstring = griffe.Docstring(text, lineno=obj.lineno, parent=obj)
        if obj.docstring is not None and obj.docstring.value:
            obj.docstring.value = _rewrite(obj, obj.docstring.value)
