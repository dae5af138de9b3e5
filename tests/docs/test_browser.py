"""The built site in a real browser: Debian's headless Chromium loads the home page, the API reference and the
benchmark pages from a server on loopback, and each must load without a console error, an uncaught exception or a
failed resource, and show its tables. Screenshots are kept in bench/results/screenshots/ (a CI artefact)."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs._browser import Browser, chromium
from tests.docs.conftest import ROOT

SHOTS = ROOT / "bench" / "results" / "screenshots"

# page -> what it must show: at least this many tables, and these texts
PAGES = {
    "index.html": (1, ["Bunshin", "Headline numbers"]),
    "reference/index.html": (1, ["bunshin_async.rollout", "speculator"]),
    "reference/bunshin_async.html": (0, ["Workspace", "BunshinError", "Snapshot", "fork"]),
    "reference/bunshin_async.rollout.html": (0, ["GroupRollout", "Budget"]),
    "benchmarks/index.html": (2, ["Headline numbers", "All benchmarks"]),
    "benchmarks/fork.html": (2, ["BunshinFork", "load average"]),
}


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    executable = chromium()
    assert executable, "chromium is not installed (bunshin_async/system-packages.txt; run make setup)"
    b = Browser(executable)
    try:
        yield b
    finally:
        b.close()


@pytest.mark.parametrize("page", list(PAGES))
def test_page_renders_without_errors(page: str, served: str, browser: Browser) -> None:
    errors = browser.open(served + page)
    assert errors == [], errors
    tables, texts = PAGES[page]
    assert browser.evaluate("document.querySelectorAll('article table').length") >= tables
    body = browser.evaluate("document.body.innerText")
    for text in texts:
        assert text in body, (page, text)
    # the theme's own stylesheet and script ran: the navigation is drawn and the search box exists
    assert browser.evaluate("!!document.querySelector('.md-nav') && !!document.querySelector('.md-search')")
    shot = browser.screenshot(SHOTS / (page.replace("/", "_").removesuffix(".html") + ".png"))
    print(f"screenshot: {shot}")
    assert shot.stat().st_size > 10_000


def test_a_broken_page_is_caught(served: str, browser: Browser, site: Path) -> None:
    """The check can fail: a page that logs an error and loads a missing script is reported."""
    bad = site / "broken-for-test.html"
    bad.write_text("<html><body><table></table><script src='missing.js'></script>"
                   "<script>console.error('boom')</script></body></html>")  # fmt: skip
    try:
        errors = browser.open(served + bad.name)
    finally:
        bad.unlink()
    assert any("boom" in e for e in errors), errors
    assert any("missing.js" in e or "404" in e for e in errors), errors
