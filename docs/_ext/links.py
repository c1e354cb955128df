"""MkDocs hook: a link to a file left out of the site fails a strict build.

``validation:`` in mkdocs.yml makes a link to a missing file, a missing
anchor or a missing nav entry a WARNING, which ``mkdocs build --strict``
turns into an error. A link to a file that exists but is excluded from the
site (``exclude_docs``: the Markdown tables under figures/, which pages
include as snippets) is just as dead in the built site, yet MkDocs logs it at
INFO whatever ``validation:`` says. This hook raises that message to a
WARNING. Links between excluded files are not checked (MkDocs logs them at
DEBUG, below this hook).
"""

from __future__ import annotations

import logging

#: What MkDocs (1.6) says about a page's link to an excluded file.
_EXCLUDED = "which is excluded from the built site"


class _ExcludedLinkIsAWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO and _EXCLUDED in record.getMessage():
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def on_config(config):
    logger = logging.getLogger("mkdocs.structure.pages")
    if not any(isinstance(f, _ExcludedLinkIsAWarning) for f in logger.filters):
        logger.addFilter(_ExcludedLinkIsAWarning())
    return config
