"""Browser check of the documentation site.

Builds the site with ``mkdocs build --strict`` into a temporary folder, serves
it on a free localhost port, and loads every page in headless Chromium
(Debian's ``chromium``; Playwright never downloads a browser here) in a
1280 x 900 window, a common laptop screen. Every page must

* render its ``<h1>``, log no console error or uncaught exception, request
  nothing outside the site, and link only to anchors that exist on it (the
  table of contents included);
* load every image, and link a figure shown at less than 60 % of its size to
  its full-size file;
* fit its text column: nothing may stick out of it or be cut off by a box
  narrower than its content. Only code scrolls sideways, by design: notebook
  code cells, printed output and Markdown code blocks (not API signatures,
  which wrap). On notebook pages at most 40 % of the code cells may scroll;
* render math as math: no backslash, stray ``&`` alignment marker or ignored
  line break inside rendered MathML, no formula left as TeX, no raw ``$...$``
  or TeX command in the text;
* give every table a header: no empty header row, no header cell without a
  name (except the index corner of a pandas table), and no column empty in
  every row.

Skipped, with the reason, when Chromium or the Playwright package is missing.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

sync_api = pytest.importorskip(
    "playwright.sync_api",
    reason="the Playwright package is not installed (pip install -e '.[docs]')",
)

CHROMIUM = "/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else shutil.which("chromium")
if not CHROMIUM:
    pytest.skip(
        "no Chromium: install Debian's `chromium` package (/usr/bin/chromium)",
        allow_module_level=True,
    )

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 30_000
#: The window the layout is checked in: a common laptop screen.
VIEWPORT = {"width": 1280, "height": 900}
#: At most this share of a notebook page's code cells may scroll sideways.
MAX_SCROLLING_CELLS = 0.4

#: Tutorial notebooks, in the order of the site's navigation.
NOTEBOOKS = [
    "01_verify_problem",
    "02_online_softmax_lse_merge",
    "03_flash_decode_splitting",
    "04_one_launch",
    "05_parity",
    "06_performance",
    "06b_knobs",
    "07_context_parallel",
    "08_gpu_lab",
]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built strictly (any warning fails) into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (out / "index.html").is_file()
    return out


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass


@pytest.fixture(scope="module")
def base_url(site):
    """http://127.0.0.1:PORT/ serving the built site from a background thread."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


# Resolves to the list of <img> elements that did not load, after making lazy
# images eager and waiting for every image to finish (or fail) loading.
_BROKEN_IMAGES_JS = """
async () => {
  const imgs = Array.from(document.images);
  for (const img of imgs) { if (img.loading === "lazy") img.loading = "eager"; }
  await Promise.all(imgs.map(img => img.complete ? null : new Promise(done => {
    img.addEventListener("load", done, { once: true });
    img.addEventListener("error", done, { once: true });
  })));
  return imgs.filter(img => !(img.complete && img.naturalWidth > 0))
             .map(img => (img.currentSrc || img.src || "<no src>").slice(0, 120));
}
"""


# Resolves to the TeX formulas ($...$) still raw in the notebooks' Markdown
# cells, outside code: the MathML hook should have converted every one.
_RAW_TEX_JS = r"""
() => {
  const raw = [];
  for (const cell of document.querySelectorAll(".jp-RenderedMarkdown")) {
    const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT, {
      acceptNode: n => n.parentElement.closest("code, pre, math")
        ? NodeFilter.FILTER_REJECT : NodeFilter.FILTER_ACCEPT,
    });
    let text = "";
    while (walker.nextNode()) text += walker.currentNode.nodeValue;
    raw.push(...(text.match(/\$[^\s$][^$]*\$/g) || []).map(m => m.slice(0, 80)));
  }
  return raw;
}
"""
# Resolves to what is wrong with the rendered math of the page: backslashes
# (TeX that latex2mathml copied instead of converting, e.g. ``\_`` inside
# ``\text{}``), stray ``&`` (an alignment environment it did not understand),
# ``<mspace linebreak>`` (a ``\\`` outside a table: browsers ignore it and the
# lines run together), <merror>, formulas the hook left as TeX, and TeX
# commands in the page's text outside code and math.
_MATH_JS = r"""
() => {
  const bad = [];
  const article = document.querySelector("article");
  const show = el => (el.closest("math") || el).textContent.replace(/\s+/g, " ").trim().slice(0, 60);
  for (const math of article.querySelectorAll("math")) {
    if (math.textContent.includes("\\")) bad.push(`backslash in rendered math: "${show(math)}"`);
    for (const el of math.querySelectorAll("mi, mo, mn, mtext")) {
      if (el.textContent.trim() === "&") { bad.push(`stray "&" in rendered math: "${show(math)}"`); break; }
    }
    if (math.querySelector("merror")) bad.push(`<merror> in rendered math: "${show(math)}"`);
    if (math.querySelector("mspace[linebreak]"))
      bad.push(`line break that browsers ignore (\\\\ outside an aligned/cases table): "${show(math)}"`);
  }
  for (const code of article.querySelectorAll("code.tex"))
    bad.push(`formula left as TeX: "${code.textContent.slice(0, 60)}"`);
  const walker = document.createTreeWalker(article, NodeFilter.SHOW_TEXT, {
    // Not code, printed output or math; not the hidden copy of each code cell's source.
    acceptNode: n => n.parentElement.closest(
      "code, pre, math, script, style, textarea, kbd, samp, .highlight, .jp-CodeCell, .clipboard-copy-txt, [hidden]")
      ? NodeFilter.FILTER_REJECT : NodeFilter.FILTER_ACCEPT,
  });
  while (walker.nextNode()) {
    const m = walker.currentNode.nodeValue.match(/\\(?:[A-Za-z]{2,}|[_{}])/);
    if (m) bad.push(`raw TeX in the text: "...${walker.currentNode.nodeValue.trim().slice(0, 60)}"`);
  }
  return bad;
}
"""

# Resolves to the layout problems of the page at the current window size:
# content sticking out of the text column, or hidden by a box narrower than
# its content, outside the code regions that scroll by design. Also counts
# the notebook code cells that scroll, and printed output that wraps lines
# mid-word.
_LAYOUT_JS = r"""
() => {
  const column = document.querySelector(".md-content");
  const edge = column.getBoundingClientRect().right + 1;
  // Code scrolls sideways by design: notebook input cells, printed output,
  // Markdown code blocks. Not API signatures: they wrap.
  const mayScroll = el => !el.closest(".doc-signature") && el.matches(
    ".highlight-ipynb, .jp-OutputArea-output, .jp-OutputArea-output pre, .jp-RenderedText, pre, pre > code, .highlight");
  const name = el => {
    let s = el.tagName.toLowerCase() + [...el.classList].slice(0, 2).map(c => "." + c).join("");
    const text = (el.textContent || "").replace(/\s+/g, " ").trim().slice(0, 50);
    return text ? `${s} "${text}"` : s;
  };
  const clipsX = el => getComputedStyle(el).overflowX !== "visible";
  const problems = [];
  for (const el of document.querySelector("article").querySelectorAll("*")) {
    const style = getComputedStyle(el);
    if (style.display === "none" || style.visibility === "hidden") continue;
    const r = el.getBoundingClientRect();
    if (r.width === 0 && r.height === 0) continue;
    if (clipsX(el) && el.scrollWidth > el.clientWidth + 1 && !mayScroll(el)) {
      const inner = [...el.querySelectorAll("*")].find(d => d.getBoundingClientRect().right > r.right + 1);
      problems.push(`${name(el)}: ${el.scrollWidth - el.clientWidth}px of its content hidden ` +
                    `(overflow-x: ${style.overflowX})` + (inner ? `, e.g. ${name(inner)}` : ""));
      continue;
    }
    if (r.right > edge) {
      let a = el.parentElement;
      while (a && a !== column && !clipsX(a)) a = a.parentElement;
      if (!a || a === column) problems.push(`${name(el)}: ${Math.round(r.right - edge)}px past the text column`);
    }
  }
  for (const pre of document.querySelectorAll(".jp-OutputArea-output pre")) {
    const st = getComputedStyle(pre);
    if (st.whiteSpace !== "pre" && (st.wordBreak === "break-all" || ["anywhere", "break-word"].includes(st.overflowWrap))) {
      problems.push(`printed output wraps lines mid-word (white-space: ${st.whiteSpace}, word-break: ${st.wordBreak})`);
      break;
    }
  }
  const cells = [...document.querySelectorAll(".jp-CodeCell .highlight-ipynb")];
  const scrolling = cells.filter(el => el.scrollWidth > el.clientWidth + 1).length;
  return { problems, cells: cells.length, scrolling };
}
"""

# Resolves to the tables of the page that lack a header or have an empty column.
_TABLES_JS = r"""
() => {
  const bad = [];
  const text = el => el.textContent.replace(/\s+/g, " ").trim();
  const empty = el => !text(el) && !el.querySelector("img, svg, math");
  [...document.querySelectorAll("article table")].forEach((table, t) => {
    const label = `table ${t + 1} ("${text(table).slice(0, 50)}")`;
    const heads = [...table.querySelectorAll("thead tr")];
    if (!heads.length && !table.querySelector("th")) { bad.push(`${label}: no header row`); return; }
    for (const row of heads) {
      const cells = [...row.children];
      if (cells.every(empty)) { bad.push(`${label}: empty header row`); continue; }
      cells.forEach((cell, i) => {
        const pandasCorner = table.classList.contains("dataframe") && i === 0;
        if (empty(cell) && !pandasCorner) bad.push(`${label}: header cell ${i + 1} has no name`);
      });
    }
    const rows = [...table.querySelectorAll("tbody tr")].map(r => [...r.children]);
    if (rows.length >= 2) {
      const width = Math.max(...rows.map(r => r.length));
      for (let i = 0; i < width; i++) {
        if (rows.every(r => !r[i] || empty(r[i]))) {
          const head = heads.length ? text(heads[heads.length - 1].children[i] || table) : "";
          bad.push(`${label}: column ${i + 1} ("${head.slice(0, 30)}") is empty in every row`);
        }
      }
    }
  });
  return bad;
}
"""

# Resolves to the figures (files, not inline data: images) shown at less than
# 60 % of their width without a link to the full-size file.
_SMALL_FIGURES_JS = r"""
() => [...document.querySelectorAll("article img")]
  .filter(img => !img.src.startsWith("data:") && img.naturalWidth > 0)
  .filter(img => img.getBoundingClientRect().width < 0.6 * img.naturalWidth)
  .filter(img => !(img.closest("a[href]") && img.closest("a[href]").href === img.src))
  .map(img => `${img.src.split("/").pop()}: shown at ${Math.round(img.getBoundingClientRect().width)} of ` +
              `${img.naturalWidth}px, with no link to the full-size file`)
"""

# Resolves to the page's own links (href="#...", the table of contents too)
# that point at no element of the page.
_DEAD_ANCHORS_JS = r"""
() => [...new Set([...document.querySelectorAll('a[href^="#"]')].map(a => a.getAttribute("href")))]
  .filter(h => h.length > 1 && !document.getElementById(decodeURIComponent(h.slice(1))))
"""
#: The docs build renders notebook math to MathML only with latex2mathml.
HAVE_LATEX2MATHML = importlib.util.find_spec("latex2mathml") is not None


def load(browser, base_url: str, path: str):
    """Open ``path``; return the page and what went wrong while loading it."""
    page = browser.new_page(viewport=VIEWPORT)
    problems = {"console errors": [], "page errors": [], "outside requests": [], "failed requests": []}
    page.on("console", lambda msg: msg.type == "error" and problems["console errors"].append(msg.text))
    page.on("pageerror", lambda err: problems["page errors"].append(str(err)))
    page.on("requestfailed", lambda req: problems["failed requests"].append(f"{req.url} ({req.failure})"))

    def only_the_site(route):
        url = route.request.url
        if url.startswith(base_url) or url.startswith(("data:", "blob:", "about:")):
            route.continue_()
        else:  # the site must be self-contained: no fonts, scripts or images from elsewhere
            problems["outside requests"].append(url)
            route.abort()

    page.route("**/*", only_the_site)
    response = page.goto(base_url + path, wait_until="load", timeout=TIMEOUT_MS)
    assert response is not None and response.ok, f"{path}: HTTP {response and response.status}"
    page.wait_for_load_state("networkidle", timeout=TIMEOUT_MS)
    return page, problems


def check_page(page, problems, path: str) -> str:
    """Common assertions; returns the text of the page's first <h1>."""
    h1 = page.locator("article h1").first
    h1.wait_for(state="visible", timeout=TIMEOUT_MS)
    title = h1.inner_text().replace("¶", "").strip()
    assert title, f"{path}: empty <h1>"
    broken = page.evaluate(_BROKEN_IMAGES_JS)
    assert not broken, f"{path}: images that did not load: {broken}"
    assert not any(problems.values()), f"{path}: {problems}"
    dead = page.evaluate(_DEAD_ANCHORS_JS)
    assert not dead, f"{path}: links to no heading or element of the page: {dead}"
    small = page.evaluate(_SMALL_FIGURES_JS)
    assert not small, f"{path}: figures too small to read: {small}"
    tables = page.evaluate(_TABLES_JS)
    assert not tables, f"{path}: tables: {tables}"
    if HAVE_LATEX2MATHML:
        math = page.evaluate(_MATH_JS)
        assert not math, f"{path}: math: {math}"
    layout = page.evaluate(_LAYOUT_JS)
    assert not layout["problems"], (
        f"{path}: layout at {VIEWPORT['width']} px:\n  " + "\n  ".join(layout["problems"][:20])
    )
    if layout["cells"]:
        assert layout["scrolling"] <= MAX_SCROLLING_CELLS * layout["cells"], (
            f"{path}: {layout['scrolling']} of {layout['cells']} code cells scroll sideways "
            f"at {VIEWPORT['width']} px: the text column is too narrow"
        )
    return title


def test_home_page(browser, base_url):
    page, problems = load(browser, base_url, "")
    try:
        assert check_page(page, problems, "/") == "splitkv"
        assert page.locator("article img").count() >= 1, "the home page shows a figure"
        body = page.locator("article").inner_text()
        assert "make demo" in body and "make test" in body
    finally:
        page.close()


def test_api_page(browser, base_url):
    page, problems = load(browser, base_url, "api/")
    try:
        assert check_page(page, problems, "/api/") == "API reference"
        for name in ("verify_splitkv_fwd", "VerifySplitKV", "choose_n_splits", "splitkv.merge"):
            assert page.locator(f'[id="splitkv.{name.removeprefix("splitkv.")}"]').count() >= 1, (
                f"no API entry for {name}"
            )
    finally:
        page.close()


def test_benchmarks_page(browser, base_url):
    page, problems = load(browser, base_url, "benchmarks/")
    try:
        assert check_page(page, problems, "/benchmarks/") == "Benchmarks"
        assert page.locator("article img").count() >= 2, "roofline and speedup figures"
        assert page.locator("article table").count() >= 1, "the H200 results table (a snippet)"
    finally:
        page.close()


def test_the_site_publishes_no_solution(site):
    # The exercises' solutions (notebooks/solutions/) stay off the site; the learner's stub file may be there.
    assert not (site / "notebooks" / "solutions").exists()
    assert not [p for p in site.rglob("*") if p.is_file() and p.suffix in (".html", ".py", ".json")
                and "def solution_" in p.read_text(errors="ignore")]


@pytest.mark.parametrize("path", ["integration/", "design/", "instructor/"])
def test_other_page(browser, base_url, path):
    page, problems = load(browser, base_url, path)
    try:
        check_page(page, problems, "/" + path)
    finally:
        page.close()


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_page(browser, base_url, name):
    path = f"notebooks/{name}/"
    page, problems = load(browser, base_url, path)
    try:
        check_page(page, problems, path)
        assert page.locator(".jupyter-wrapper .jp-Cell").count() >= 1, f"{path}: no notebook cells"
        if HAVE_LATEX2MATHML:
            raw = page.evaluate(_RAW_TEX_JS)
            assert not raw, f"{path}: math left as raw TeX: {raw}"
    finally:
        page.close()
