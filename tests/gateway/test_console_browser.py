"""The console in a real headless browser (Playwright driving Debian's chromium): sign in with an API key,
create a key and see it once, revoke it, watch the API refuse it and the refusal reach the audit tail,
with no CSP violation reported on the way.

chromium comes from Debian (``.ci/run`` installs it when missing), never from ``playwright install``.
Outside CI a machine without it skips this test, saying so; under CI (``$CI`` set, e.g. ``CI=true``) it fails.
``INFERFLUX_CONSOLE_SCREENSHOTS=1`` writes the screenshots the docs show into docs/img/.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from admin_seed import Seeded, seed_store
from console_support import console_app, key_of
from servers import start_uvicorn, stop_uvicorn

pytestmark = pytest.mark.slow  # a browser process and a live server

CHROMIUM = Path(os.environ.get("INFERFLUX_CHROMIUM", "/usr/bin/chromium"))
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"


def _browser_or_skip() -> Any:
    reason = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        reason = "the playwright package is not installed (pip install -e '.[dev]')"
    if reason is None and not CHROMIUM.exists():
        reason = f"no chromium at {CHROMIUM} (apt-get install chromium; .ci/run does)"
    if reason is not None:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):  # as tests/conftest.py reads $CI
            pytest.fail(f"the console's browser test cannot run under CI: {reason}")
        pytest.skip(reason)
    return sync_playwright


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Seeded, str]]:
    data_dir = tmp_path_factory.mktemp("console-browser")
    seeded = seed_store(data_dir)
    server, thread, sock, url = start_uvicorn(console_app(seeded.store, data_dir / "app"))
    try:
        yield seeded, url
    finally:
        stop_uvicorn(server, thread, sock)
        seeded.store.close()


def _violations(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("inferflux_console_csp_violations "):
            return float(line.split()[1])
    raise AssertionError("no CSP violation gauge")


def test_sign_in_create_see_once_revoke_refused_audited(live: tuple[Seeded, str], tmp_path: Path) -> None:
    sync_playwright = _browser_or_skip()
    seeded, url = live
    shots = DOCS_IMG if os.environ.get("INFERFLUX_CONSOLE_SCREENSHOTS") == "1" else tmp_path
    shots.mkdir(parents=True, exist_ok=True)
    keys_url = f"{url}/console/tenants/{seeded.acme.id}/keys"
    csp_messages: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS, headless=True)
        page = browser.new_page(viewport={"width": 1440, "height": 800})
        page.on("console", lambda m: csp_messages.append(m.text) if "Content Security Policy" in m.text else None)
        page.on("dialog", lambda dialog: dialog.accept())

        page.goto(f"{url}/console/tenants/{seeded.acme.id}/keys")
        assert page.url.startswith(f"{url}/console/login?next=")
        page.screenshot(path=str(shots / "console-login.png"))
        page.fill("input[name=api_key]", key_of(seeded.admin))
        with page.expect_navigation():  # each form post is a navigation: wait for its page, not the old one
            page.click("#login button[type=submit]")
        assert page.url == keys_url, (page.url, page.content()[:3000])

        page.fill("#create input[name=name]", "browser-made")
        page.select_option("#create select[name=role]", "member")
        with page.expect_navigation():
            page.click("#create button[type=submit]")
        secret = page.input_value("#new-key-value")
        assert secret.startswith("ifx_"), secret
        prefix = page.text_content("#new-key h2").split()[-1]  # type: ignore[union-attr]
        # The key is masked in the picture: a secret-looking string in docs/ would alarm every scanner.
        page.screenshot(path=str(shots / "console-keys.png"), full_page=True, mask=[page.locator("#new-key-value")])
        assert httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {secret}"}).status_code == 200

        page.goto(keys_url)  # again: the key is not shown any more, only its prefix
        assert page.locator("#new-key-value").count() == 0 and secret not in page.content()
        row = page.locator("tr", has_text=prefix)
        with page.expect_navigation():
            row.locator("button[value=revoke]").click()
        assert page.locator("tr", has_text=prefix).locator("td[data-col=revoked_at]").text_content()

        refused = httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {secret}"})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"

        page.goto(f"{url}/console/audit")  # the audit tail: the refusal is there once the indexer has it
        deadline = time.monotonic() + 30
        while not page.locator("tbody tr", has_text=prefix).filter(has_text="401").count():
            assert time.monotonic() < deadline, page.text_content("#rows")
            time.sleep(1)
            page.reload()
        page.screenshot(path=str(shots / "console-audit.png"), full_page=True)

        page.goto(f"{url}/console/usage?group=minute&by=tenant,key")  # the calls above, once rolled up
        deadline = time.monotonic() + 15
        while not page.locator("#usage tbody tr").count() and time.monotonic() < deadline:
            time.sleep(1)
            page.reload()
        # At 1280 px the table and the charts fit: nothing scrolls sideways, the page nor its main column.
        page.set_viewport_size({"width": 1280, "height": 800})
        for path in ("/console/usage?group=minute&by=tenant,key", "/console/usage?by=tenant,key,model",
                     "/console/audit", f"/console/tenants/{seeded.acme.id}/keys"):  # fmt: skip
            page.goto(url + path)
            widths = page.evaluate("() => { const m = document.querySelector('main'); return [document.scrollingElement"
                                   ".scrollWidth, innerWidth, m.scrollWidth, m.clientWidth]; }")  # fmt: skip
            assert widths[0] <= widths[1] and widths[2] <= widths[3], (path, widths)
        page.goto(f"{url}/console/usage?group=minute&by=tenant,key")
        headers = page.locator("#usage thead th").all_text_contents()
        assert len(headers) == len(set(headers)), headers
        assert page.locator("#usage td[data-col=tenant_id]", has_text="acme").count()
        # The charts are drawn (inline SVG, laid out) with a point per hour and series.
        for chart in ("#chart-requests", "#chart-total-tokens"):
            box = page.locator(f"{chart} svg.chart").bounding_box()
            assert box is not None and box["width"] > 300 and box["height"] > 100, (chart, box)
            assert page.locator(f"{chart} g.point").count() >= 24
        assert page.locator("#chart-requests ul.legend li", has_text="acme").count() == 1
        page.screenshot(path=str(shots / "console-usage.png"), full_page=True)
        page.set_viewport_size({"width": 1440, "height": 800})

        page.goto(f"{url}/console/live")
        # A locator, not wait_for_function: its polling evaluates a string, which the CSP refuses (and reports).
        page.locator("#live-status", has_text="Live.").wait_for()
        page.locator("#live tbody").wait_for(state="attached")
        page.screenshot(path=str(shots / "console-live.png"))

        # No page broke the policy; and a violation would have been seen: an inline script is refused and reported.
        assert csp_messages == [] and _violations(url) == 0
        page.evaluate("() => { const s = document.createElement('script'); s.textContent = '1'; "
                      "document.body.append(s); }")  # fmt: skip
        deadline = time.monotonic() + 15
        while _violations(url) < 1:
            assert time.monotonic() < deadline, "an inline script was not reported"
            time.sleep(0.2)
        assert any(re.search("script-src", m) for m in csp_messages)
        browser.close()
