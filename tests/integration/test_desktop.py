"""The desktop: E2B's `e2b-desktop` SDK (pinned, in its own environment, unchanged) drives a
`desktop` sandbox of a real daemon. Its browser opens a page this test serves on loopback
(the operator's host table names it), the SDK's screenshot shows the page's colour, text
typed with the SDK's keyboard reaches the page (its form is sent back to this server), and
the noVNC stream is served through the sandbox's port 6080. cella's own SDK takes a PNG of
the same screen; a sandbox without a desktop is refused by name."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import sync_playwright

from cella import AsyncClient, Client, Sandbox, errors
from cella.images.templates import build_template, builtin_templates
from cella.paths import Paths
from tests.daemon import Daemon
from tests.integration.test_console import CHROMIUM, logged_in, screenshot
from tests.netservers import Recorder, Servers, free_loopback_block
from tests.sdk_env import run_script, sdk_python

pytestmark = [pytest.mark.vm, pytest.mark.timeout(1200)]  # the first run makes the warm snapshot
DESKTOP = ["e2b==2.63.0", "e2b-desktop==2.7.2"]
HOST = "page.desktop.test"
COLOUR = (18, 196, 139)  # the page's background: a green no desktop theme uses
THANKS = (201, 43, 94)  # the background of the page the form leads to
PAGE = f"""<!doctype html>
<html><head><title>cella desktop test</title></head>
<body style="margin:0; background: rgb{COLOUR}; height: 100vh">
<form action="/typed" method="get">
<input name="q" autofocus autocomplete="off" style="position: fixed; left: 10%; width: 80%;
  top: 35%; height: 30%; font-size: 40px; border: 0; background: rgb(250, 250, 250)">
</form></body></html>
""".encode()
THANKS_PAGE = f"""<!doctype html>
<html><head><title>thanks</title></head>
<body style="margin:0; background: rgb{THANKS}; height: 100vh">thanks</body></html>
""".encode()


class PageHandler(http.server.BaseHTTPRequestHandler):
    """`/`: the page; `/typed?q=...` (where its form leads): a page of another colour. Every
    request is recorded."""

    recorder: Recorder
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.recorder.add({"path": self.path})
        body = PAGE if self.path == "/" else THANKS_PAGE
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class Page:
    addr: str
    seen: Recorder


@pytest.fixture(scope="module")
def page() -> Iterator[Page]:
    addr = f"{free_loopback_block()}.1"
    servers = Servers()
    seen = servers.start(PageHandler, (addr, 80))
    yield Page(addr, seen)
    servers.close()


@pytest.fixture(scope="module", autouse=True)
def desktop_template() -> None:
    """The template, built unless it is (scripts/test's set-up builds it beforehand)."""
    build_template(Paths.default(), builtin_templates()["desktop"])


@pytest.fixture(scope="module")
def daemon_settings(page: Page) -> dict[str, str]:
    return {"pool_size": "0", "egress_hosts": json.dumps({HOST: page.addr})}


@pytest.fixture(scope="module")
def python() -> Path:
    return sdk_python("e2b-desktop-2.7.2", DESKTOP)


def desktop(python: Path, daemon: Daemon, script: str) -> Any:
    env = {
        "E2B_API_URL": daemon.url,
        "E2B_SANDBOX_URL": daemon.url,
        "E2B_API_KEY": daemon.admin_key,
    }
    preamble = "import base64, json, time\nfrom e2b_desktop import Sandbox\n"
    return run_script(python, preamble + textwrap.dedent(script), env, timeout=900)


def share_of(png: bytes, colour: tuple[int, int, int]) -> float:
    """How much of the picture is exactly `colour`."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    counts = {c: n for n, c in image.getcolors(maxcolors=1 << 24) or []}
    return counts.get(colour, 0) / (image.width * image.height)


@pytest.fixture(scope="module")
def driven(python: Path, daemon: Daemon, admin: Client) -> Iterator[dict[str, Any]]:
    """One desktop sandbox, driven by e2b-desktop (then left running for the other checks):
    screenshots before and after its browser opens the served page, text typed into the
    page, and the stream started."""
    got: dict[str, Any] = desktop(
        python,
        daemon,
        f"""
        import os, urllib.request
        out = {{}}
        sb = Sandbox.create(timeout=900, network={{"allow_out": ["{HOST}"]}})
        out["id"] = sb.sandbox_id
        out["size"] = list(sb.get_screen_size())
        out["before"] = base64.b64encode(sb.screenshot()).decode()
        sb.open("http://{HOST}/")
        title = ""
        for _ in range(120):  # the browser's first start is slow under emulation
            time.sleep(2)
            title = sb.commands.run("xdotool getactivewindow getwindowname || true").stdout
            if "cella desktop test" in title:
                break
        time.sleep(3)  # painted, not only titled
        out["title"] = title
        out["page"] = base64.b64encode(sb.screenshot()).decode()
        geo = dict(line.split("=", 1) for line in sb.commands.run(
            "xdotool getactivewindow getwindowgeometry --shell").stdout.split())
        x, y, w, h = (int(geo[k]) for k in ("X", "Y", "WIDTH", "HEIGHT"))
        sb.left_click(x + w // 2, y + h // 2 + 40)  # the page's big text field
        sb.write("hello desktop")
        sb.press("enter")
        sb.stream.start()
        url = sb.stream.get_url()
        host = url.split("://", 1)[1].split("/", 1)[0]
        req = urllib.request.Request(os.environ["E2B_API_URL"] + "/vnc.html",
                                     headers={{"Host": host}})
        with urllib.request.urlopen(req, timeout=60) as r:
            out["stream"] = [url, r.status, "noVNC" in r.read().decode()]
        print(json.dumps(out))
        """,
    )
    yield got
    admin.get(got["id"]).delete()


def test_e2b_desktop_shows_the_served_page(driven: dict[str, Any]) -> None:
    assert driven["size"] == [1024, 768]
    assert share_of(base64.b64decode(driven["before"]), COLOUR) < 0.01  # not there before
    assert "cella desktop test" in driven["title"], driven["title"]
    assert share_of(base64.b64decode(driven["page"]), COLOUR) > 0.3  # the page fills the browser


def test_e2b_desktop_types_into_the_page(driven: dict[str, Any], page: Page) -> None:
    typed = {"path": "/typed?q=hello+desktop"}  # the page's form, sent with what was typed
    for _ in range(60):
        if typed in page.seen.requests:
            break
        time.sleep(1)
    assert typed in page.seen.requests, page.seen.requests
    assert {"path": "/"} in page.seen.requests  # the control: the page itself, before


def test_e2b_desktop_streams_through_port_6080(driven: dict[str, Any]) -> None:
    url, status, novnc = driven["stream"]
    assert url.startswith(f"https://6080-{driven['id']}") and "/vnc.html?" in url
    assert status == 200 and novnc  # noVNC's page, through the sandbox's service host


def test_cella_screenshot_of_the_same_screen(
    driven: dict[str, Any], admin: Client, daemon: Daemon, tmp_path: Path
) -> None:
    sb = admin.get(driven["id"])
    for _ in range(30):  # the page the typed form led to, once the browser has painted it
        png = sb.screenshot()
        if share_of(png, THANKS) > 0.3:
            break
        time.sleep(1)
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert Image.open(io.BytesIO(png)).size == (1024, 768)
    assert share_of(png, THANKS) > 0.3 and share_of(png, COLOUR) < 0.01  # what is on screen now

    async def from_async() -> bytes:
        async with AsyncClient(daemon.url, api_key=daemon.admin_key) as client:
            return await (await client.get(driven["id"])).screenshot()

    assert Image.open(io.BytesIO(asyncio.run(from_async()))).size == (1024, 768)
    saved = tmp_path / "screen.png"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cella.cli",
            "sandbox",
            "screenshot",
            driven["id"],
            "-o",
            str(saved),
        ],
        env=daemon.env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert Image.open(saved).size == (1024, 768)


@pytest.fixture(scope="module")
def plain(admin: Client) -> Iterator[Sandbox]:
    """A sandbox of the `default` template: no desktop."""
    sb = admin.create(template="default")
    yield sb
    sb.delete()


def test_a_sandbox_without_a_desktop_has_no_screenshot(plain: Sandbox) -> None:
    """The control: the same call on a `default` sandbox is refused, naming why."""
    assert plain.exec("echo up").stdout == b"up\n"  # the sandbox itself answers
    with pytest.raises(errors.InvalidState, match="has no desktop"):
        plain.screenshot()


def test_the_console_shows_the_screen(
    driven: dict[str, Any], plain: Sandbox, daemon: Daemon, tmp_path: Path
) -> None:
    """The sandbox's page has a `screen` tab showing the screenshot (a desktop's only)."""
    if CHROMIUM is None:
        pytest.fail("chromium is not installed (scripts/test installs Debian's package)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = logged_in(browser, daemon, daemon.admin_key)
            base = page.url.split("#")[0]
            page.goto(f"{base}#/sandboxes/{plain.id}")
            page.wait_for_selector("nav.tabs a:has-text('overview')")
            assert page.locator("nav.tabs a:has-text('screen')").count() == 0  # no desktop
            page.goto(f"{base}#/sandboxes/{driven['id']}/screen")
            page.wait_for_selector("#screen", state="attached")  # the tab is there
            try:
                page.wait_for_function(
                    "() => document.querySelector('#screen').naturalWidth === 1024",
                    timeout=120_000,
                )
            except PlaywrightTimeout:
                raise AssertionError(page.inner_text("#tab")) from None
            assert page.evaluate("() => document.querySelector('#screen').naturalHeight") == 768
            assert page.evaluate("() => document.querySelector('#screen').src").startswith("blob:")
            screenshot(page, tmp_path, "screen")  # and under $CELLA_SCREENSHOTS, for docs/
        finally:
            browser.close()


def test_after_a_fresh_boot_the_screenshot_starts_the_desktop_again(
    driven: dict[str, Any], admin: Client
) -> None:
    """A stop ends every process; after the resume (a boot from the disk, which runs the
    template's warm command again, so the display may be up already) the display is killed:
    the screenshot finds none, starts it (`start-desktop`) and takes the PNG."""
    sb = admin.get(driven["id"])
    sb.stop()
    sb.resume()
    killed = sb.exec(
        "pkill -x xfce4-session; pkill -x Xvfb; "
        "for i in $(seq 100); do pgrep -x Xvfb >/dev/null || exit 0; sleep 0.1; done; exit 1"
    )
    assert killed.exit_code == 0, killed.stderr
    assert sb.exec("pgrep -x Xvfb").exit_code != 0  # the control: no display now
    png = sb.screenshot()
    assert Image.open(io.BytesIO(png)).size == (1024, 768)
    assert sb.exec("pgrep -x Xvfb").exit_code == 0
    assert sb.exec("pgrep -x xfce4-session").exit_code == 0  # the session runs again
