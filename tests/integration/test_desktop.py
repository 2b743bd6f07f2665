"""The desktop: E2B's `e2b-desktop` SDK (pinned, in its own environment, unchanged) drives a
`desktop` sandbox of a real daemon. Its browser opens a page this test serves on loopback
(the operator's host table names it), the SDK's screenshot shows the page's colour, text
typed with the SDK's keyboard reaches the page (its form is sent back to this server), and
the noVNC stream is served through the sandbox's port 6080. cella's own SDK takes a PNG of
the same screen; a sandbox without a desktop is refused by name."""

from __future__ import annotations

import base64
import io
import json
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from cella import Client, errors
from tests.daemon import Daemon
from tests.netservers import Recorder, Servers, free_loopback_block
from tests.sdk_env import run_script, sdk_python

pytestmark = [pytest.mark.vm, pytest.mark.timeout(1200)]  # the first run makes the warm snapshot
DESKTOP = ["e2b==2.63.0", "e2b-desktop==2.7.2"]
HOST = "page.desktop.test"
COLOUR = (18, 196, 139)  # the page's background: a green no desktop theme uses
PAGE = f"""<!doctype html>
<html><head><title>cella desktop test</title></head>
<body style="margin:0; background: rgb{COLOUR}; height: 100vh">
<form action="/typed" method="get">
<input name="q" autofocus autocomplete="off" style="position: fixed; left: 10%; width: 80%;
  top: 35%; height: 30%; font-size: 40px; border: 0; background: rgb(250, 250, 250)">
</form></body></html>
""".encode()


class PageHandler:
    """`/`: the page; `/typed?q=...`: what the page's form sent, recorded."""

    @staticmethod
    def make() -> type:
        import http.server

        class Handler(http.server.BaseHTTPRequestHandler):
            recorder: Recorder
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self.recorder.add({"path": self.path})
                body = PAGE if self.path == "/" else b"thanks"
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


@dataclass
class Page:
    addr: str
    seen: Recorder


@pytest.fixture(scope="module")
def page() -> Iterator[Page]:
    addr = f"{free_loopback_block()}.1"
    servers = Servers()
    seen = servers.start(PageHandler.make(), (addr, 80))
    yield Page(addr, seen)
    servers.close()


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
    pixels = image.getdata()
    return sum(1 for p in pixels if p == colour) / len(pixels)


def test_e2b_desktop_sees_and_types_into_a_served_page(
    python: Path, daemon: Daemon, admin: Client, page: Page
) -> None:
    got = desktop(
        python,
        daemon,
        f"""
        import os, urllib.request
        out = {{}}
        sb = Sandbox.create(timeout=900)
        out["id"] = sb.sandbox_id
        out["size"] = list(sb.get_screen_size())
        out["before"] = base64.b64encode(sb.screenshot()).decode()
        sb.open("http://{HOST}/")
        shot = b""
        for _ in range(120):  # the browser's first start is slow under emulation
            time.sleep(2)
            shot = bytes(sb.screenshot())
            title = sb.commands.run("xdotool getactivewindow getwindowname || true").stdout
            if "cella desktop test" in title:
                time.sleep(3)  # painted, not only titled
                shot = bytes(sb.screenshot())
                break
        out["title"] = title
        out["page"] = base64.b64encode(shot).decode()
        geo = dict(line.split("=", 1) for line in sb.commands.run(
            "xdotool getactivewindow getwindowgeometry --shell").stdout.split())
        x, y, w, h = (int(geo[k]) for k in ("X", "Y", "WIDTH", "HEIGHT"))
        sb.left_click(x + w // 2, y + h // 2 + 40)  # the page's big text field (below the toolbar)
        sb.write("hello desktop")
        sb.press("enter")
        out["typed"] = base64.b64encode(bytes(sb.screenshot())).decode()
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
    try:
        assert got["size"] == [1024, 768]
        assert share_of(base64.b64decode(got["before"]), COLOUR) < 0.01  # not there yet
        shown = base64.b64decode(got["page"])
        assert "cella desktop test" in got["title"], got["title"]
        assert share_of(shown, COLOUR) > 0.3  # the served page fills the browser
        for _ in range(60):  # the form reached this server with what was typed
            if {"path": "/typed?q=hello+desktop"} in page.seen.requests:
                break
            time.sleep(1)
        assert {"path": "/typed?q=hello+desktop"} in page.seen.requests, page.seen.requests
        url, status, novnc = got["stream"]
        assert url.startswith(f"https://6080-{got['id']}") and "/vnc.html?" in url
        assert status == 200 and novnc  # noVNC's page, through the sandbox's port 6080

        # cella's own SDK: a PNG of the same screen, at its size
        png = admin.get(got["id"]).screenshot()
        assert png.startswith(b"\x89PNG\r\n\x1a\n")
        assert Image.open(io.BytesIO(png)).size == (1024, 768)
    finally:
        admin.get(got["id"]).delete()


def test_a_sandbox_without_a_desktop_has_no_screenshot(admin: Client) -> None:
    """The control: the same call on a `default` sandbox is refused, naming why."""
    sb = admin.create(template="default")
    try:
        assert sb.exec("echo up").stdout == b"up\n"  # the sandbox itself answers
        with pytest.raises(errors.InvalidState, match="has no desktop"):
            sb.screenshot()
    finally:
        sb.delete()
