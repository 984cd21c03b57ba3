"""The documentation site in a real browser: built strictly, served on 127.0.0.1, opened in headless Chromium
(Debian's, driven by Playwright). Each checked page must render its heading, every image on it must load, and every
internal link on it must answer 200; a screenshot of each is saved (`RECGUIDE_SCREENSHOTS=DIR` keeps them).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urldefrag, urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# page: (path, its heading, the fewest images it shows: Serving's open-loop plots, Results' frontier and the rest)
PAGES = {"home": ("", "recguide-hf", 0), "serving": ("serving/", "Serving", 6), "results": ("results/", "Results", 3)}

pytest.importorskip("mkdocs")
playwright = pytest.importorskip("playwright.sync_api")
# CI installs Debian's chromium and sets RECGUIDE_REQUIRE_BROWSER: there a missing browser fails instead of skipping
REQUIRED = bool(os.environ.get("RECGUIDE_REQUIRE_BROWSER"))
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None and not REQUIRED, reason="Debian's chromium is not installed")]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built with `mkdocs build --strict`, served by `python -m http.server` on 127.0.0.1 (stopped after)."""
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                            "--site-dir", str(out)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                               "--directory", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(100):  # at most 10 s for the server to answer
            try:
                urllib.request.urlopen(base, timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        yield base
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture(scope="module")
def browser():
    assert CHROMIUM is not None, "RECGUIDE_REQUIRE_BROWSER is set but Debian's chromium is not installed"
    with playwright.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            chromium.close()


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.mark.parametrize("name", list(PAGES))
def test_page_renders_with_its_images_and_links(site, browser, name, tmp_path):
    path, heading, fewest_images = PAGES[name]
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    response = page.goto(site + path, wait_until="load")
    assert response is not None and response.ok
    assert heading in page.locator("article h1").first.inner_text()
    assert page.locator("nav").count() > 0  # the theme rendered its navigation
    assert page.locator("article img").count() >= fewest_images
    broken = page.eval_on_selector_all("article img", "imgs => imgs.filter(i => !(i.complete && i.naturalWidth > 0))"
                                       ".map(i => i.getAttribute('src'))")
    assert broken == [], f"images that did not load on {name}: {broken}"
    hrefs = page.eval_on_selector_all("a[href]", "links => links.map(a => a.href)")
    internal = sorted({urldefrag(h)[0] for h in hrefs if urlparse(h).netloc == urlparse(site).netloc})
    assert internal, "no internal links on the page"
    missing = [h for h in internal if status(h) != 200]
    assert missing == [], f"internal links that do not answer 200 on {name}: {missing}"
    shot = tmp_path / f"{name}.png"
    page.screenshot(path=str(shot), full_page=False)
    assert shot.stat().st_size > 10_000  # a rendered page, not a blank one
    keep = os.environ.get("RECGUIDE_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / shot.name)
    page.close()
