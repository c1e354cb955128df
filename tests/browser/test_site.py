"""Browser check of the documentation site.

Builds the site with ``mkdocs build --strict`` into a temporary folder, serves
it on a free localhost port, and loads pages in headless Chromium (Debian's
``chromium``; Playwright never downloads a browser here). Every page must
render its ``<h1>``, load every image, log no console error or uncaught
exception, and request nothing outside the site.

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

#: Tutorial notebooks, in the order of the site's navigation.
NOTEBOOKS = [
    "01_verify_problem",
    "02_online_softmax_lse_merge",
    "03_flash_decode_splitting",
    "04_the_two_kernels",
    "05_parity",
    "06_performance",
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
#: The docs build renders notebook math to MathML only with latex2mathml.
HAVE_LATEX2MATHML = importlib.util.find_spec("latex2mathml") is not None


def load(browser, base_url: str, path: str):
    """Open ``path``; return the page and what went wrong while loading it."""
    page = browser.new_page()
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
