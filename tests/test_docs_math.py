"""The site's build hooks fail a strict build instead of shipping broken pages: a formula that
cannot become MathML and a link to a file left out of the site are warnings, not INFO lines."""

import importlib.util
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXT = ROOT / "docs" / "_ext"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"docs_ext_{name}", EXT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def mathml():
    module = _load("mathml")
    if module._to_mathml is None:
        pytest.skip("latex2mathml is not installed (the docs extra)")
    return module


def test_a_good_formula_becomes_mathml_quietly(mathml, caplog):
    with caplog.at_level(logging.INFO, logger="mkdocs.hooks.mathml"):
        out = mathml.convert_formula(r"\frac{a}{b} + x_1", "block", "page.ipynb")
    assert out.startswith("<math") and "\\" not in out
    assert not caplog.records


@pytest.mark.parametrize("tex", [r"a^{", r"\left( x", r"\begin{foo} x", r"\notacommand{x} + 1"])
def test_a_bad_formula_stays_tex_and_is_a_warning(mathml, caplog, tex):
    with caplog.at_level(logging.INFO, logger="mkdocs.hooks.mathml"):
        out = mathml.convert_formula(tex, "inline", "notebooks/99_x.ipynb")
    assert out.startswith('<code class="tex">')
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "notebooks/99_x.ipynb" in warnings[0].getMessage()


def test_pages_are_converted_through_the_same_check(mathml, caplog):
    with caplog.at_level(logging.INFO, logger="mkdocs.hooks.mathml"):
        out = mathml.convert_html("<p>fine $x^2$ and broken $a^{$</p><code>$not math^{$</code>", "p.ipynb")
    assert "<math" in out and '<code class="tex">a^{</code>' in out and "<code>$not math^{$</code>" in out
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_without_latex2mathml_the_build_warns(monkeypatch, caplog):
    module = _load("mathml")
    monkeypatch.setattr(module, "_to_mathml", None)
    monkeypatch.setattr(module, "_warned_missing", False)
    with caplog.at_level(logging.INFO, logger="mkdocs.hooks.mathml"):
        assert module.convert_formula("x", "inline", "p.ipynb") == '<code class="tex">x</code>'
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_a_link_to_an_excluded_file_becomes_a_warning():
    links = _load("links")
    links.on_config({})
    message = "Doc file 'a.md' contains a link to 'figures/t.md' which is excluded from the built site."
    record = logging.LogRecord("mkdocs.structure.pages", logging.INFO, __file__, 1, message, None, None)
    for f in logging.getLogger("mkdocs.structure.pages").filters:
        f.filter(record)
    assert record.levelno == logging.WARNING


def _site(tmp_path, page):
    (tmp_path / "docs" / "figures").mkdir(parents=True)
    (tmp_path / "docs" / "index.md").write_text(page)
    (tmp_path / "docs" / "figures" / "table.md").write_text("| a |\n|---|\n| 1 |\n")
    config = ROOT / "mkdocs.yml"
    validation = config.read_text().split("\nvalidation:\n", 1)[1].split("\n\n", 1)[0]
    (tmp_path / "mkdocs.yml").write_text(textwrap.dedent(f"""\
        site_name: t
        docs_dir: docs
        exclude_docs: |
          /figures/*.md
        hooks:
          - {EXT / 'links.py'}
        validation:
        """) + validation + "\n")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("page, ok", [
    ("# Home\n\nA [table](figures/table.md) left out of the site.\n", False),
    ("# Home\n\nA [page](missing.md) that is not there.\n", False),
    ("# Home\n\nA [heading](#nowhere) that is not there.\n", False),
    ("# Home\n\n## Here\n\nA [heading](#here) that is.\n", True),
])
def test_strict_build_fails_on_a_dead_link(tmp_path, page, ok):
    pytest.importorskip("mkdocs")
    run = _site(tmp_path, page)
    assert (run.returncode == 0) == ok, run.stderr[-2000:]


@pytest.mark.parametrize("formula, ok", [("$x^2 + y_1$", True), ("$a^{$", False)])
def test_strict_build_fails_on_notebook_math_it_cannot_convert(tmp_path, mathml, formula, ok):
    pytest.importorskip("mkdocs_jupyter")
    import json

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n")
    notebook = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": [f"# T\n\nA formula: {formula}\n"]}],
                "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "docs" / "t.ipynb").write_text(json.dumps(notebook))
    (tmp_path / "mkdocs.yml").write_text(textwrap.dedent(f"""\
        site_name: t
        nav: [index.md, t.ipynb]
        hooks: ["{EXT / 'mathml.py'}"]
        plugins:
          - mkdocs-jupyter:
              execute: false
              cache: false
        """))
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert (run.returncode == 0) == ok, run.stderr[-2000:]
    if ok:
        assert "<math" in (tmp_path / "site" / "t" / "index.html").read_text()
