"""The web console in a real browser (Debian's chromium, driven by Playwright) against a
real daemon with real sandboxes: log in, the live list, a terminal, files, the live trace,
the lineage picture, eval runs, tenants kept apart, CSRF. Each page's screenshot is saved
under the test's temp dir (and under `$CELLA_SCREENSHOTS`, when set, for docs/)."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2
import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import sync_playwright

from cella import Client, Sandbox, errors
from cella.eval import Task, run_eval
from tests.daemon import Daemon

pytestmark = pytest.mark.vm

CHROMIUM = shutil.which("chromium")
WIDTH, HEIGHT = 1280, 800


@pytest.fixture(scope="module")
def daemon_settings() -> dict[str, str]:
    return {"pool_size": "0"}


@pytest.fixture(scope="module")
def keys(admin: Client) -> dict[str, str]:
    return {t: admin.create_key(t)["key"] for t in ("alpha", "beta")}


@pytest.fixture(scope="module")
def alpha(daemon: Daemon, keys: dict[str, str]) -> Iterator[Client]:
    with daemon.client(keys["alpha"]) as client:
        yield client


@pytest.fixture(scope="module")
def box(alpha: Client) -> Iterator[Sandbox]:
    """The sandbox most tests look at (alpha's)."""
    sb = alpha.create(labels={"team": "console"})
    yield sb
    sb.delete()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.fail("chromium is not installed (scripts/test installs Debian's package)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


def screenshot(page: Any, shots: Path, name: str) -> None:
    painted(page)  # the last rows drawn
    path = shots / f"{name}.png"
    page.screenshot(path=str(path))
    if docs := os.environ.get("CELLA_SCREENSHOTS"):
        Path(docs).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(docs) / path.name)


def logged_in(browser: Any, daemon: Daemon, key: str) -> Any:
    context = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT})
    page = context.new_page()
    page.goto(f"{daemon.url}/ui/")
    page.fill("#key", key)
    page.click("button[type=submit]")
    page.wait_for_selector("#who:not(:empty)")
    return page


@pytest.fixture(scope="module")
def page(browser: Any, daemon: Daemon, keys: dict[str, str]) -> Iterator[Any]:
    page = logged_in(browser, daemon, keys["alpha"])
    yield page
    page.context.close()


def painted(page: Any) -> None:
    """Until the browser has painted what the page last changed (two animation frames)."""
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")


def eventually(check: Any, what: str, timeout: float = 30.0) -> None:
    """Until `check()` holds, polled; fails naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(0.1)


def sleeping(sb: Sandbox) -> bool:
    """A `sleep` runs in the guest (seen from outside the terminal)."""
    return sb.exec(["pgrep", "-x", "sleep"]).exit_code == 0


ROWS = (  # the terminal's screen as a JavaScript expression: a line each
    "[...document.querySelectorAll('.xterm-rows > div')]"
    ".map(r => r.textContent.replace(/\\s+$/, ''))"
)


def rows_text(page: Any) -> list[str]:
    """The terminal's screen, a line each (xterm.js's DOM renderer)."""
    lines: list[str] = page.evaluate(f"() => {ROWS}")
    return lines


def wait_line(page: Any, line: str, timeout: float = 20.0) -> list[str]:
    try:
        page.wait_for_function(f"line => {ROWS}.includes(line)", arg=line, timeout=timeout * 1000)
    except PlaywrightTimeout:
        raise AssertionError(
            f"{line!r} never shown; the screen:\n" + "\n".join(rows_text(page))
        ) from None
    return rows_text(page)


def test_login(browser: Any, daemon: Daemon, keys: dict[str, str], shots: Path) -> None:
    context = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT})
    page = context.new_page()
    response = page.goto(f"{daemon.url}/ui/")
    assert page.url.endswith("/ui/login")
    csp = response.headers["content-security-policy"]
    assert "script-src 'self';" in csp and "frame-ancestors 'none'" in csp
    screenshot(page, shots, "login")
    page.fill("#key", "ck_not-a-key")
    page.click("button[type=submit]")
    assert "unknown or revoked API key" in page.inner_text("[role=alert]")
    assert not context.cookies()
    page.fill("#key", keys["alpha"])
    page.click("button[type=submit]")
    page.wait_for_selector("#who:not(:empty)")
    assert page.inner_text("#who") == "alpha"
    (cookie,) = context.cookies()
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert keys["alpha"] not in cookie["value"]  # the session names the key, never holds it
    assert page.evaluate("document.cookie") == ""  # no script reads it
    with httpx2.Client(base_url=daemon.url) as http:
        forged = http.post(
            "/ui/login", data={"key": keys["alpha"]}, headers={"origin": "http://evil.test"}
        )
        assert forged.status_code == 403 and "cella_session" not in forged.cookies
        copied = {"cookie": f"cella_session={cookie['value']}"}
        assert http.get("/ui/session", headers=copied).status_code == 200
        page.click("#logout")
        page.wait_for_url("**/ui/login")
        assert not context.cookies()
        assert http.get("/ui/session", headers=copied).status_code == 401  # ended for good
    context.close()


def test_list_shows_a_new_sandbox_within_a_second(
    page: Any, alpha: Client, box: Sandbox, shots: Path
) -> None:
    page.goto(page.url.split("#")[0] + "#/sandboxes")
    page.wait_for_selector(f"#sandboxes tr[data-id='{box.id}']")
    sb = alpha.create(name="fresh-one", labels={"purpose": "list-test"})
    try:
        created = time.monotonic()
        # its row may show `creating` first (the events come in order): running within 1 s
        row_running = f"#sandboxes tr[data-id='{sb.id}']:has-text('running')"
        page.wait_for_selector(row_running, timeout=1000)
        print(f"shown {1000 * (time.monotonic() - created):.0f} ms after the create returned")
        row = page.inner_text(f"#sandboxes tr[data-id='{sb.id}']")
        assert "fresh-one" in row and "running" in row and "purpose=list-test" in row
        page.fill("#search", "list-test")  # search narrows the list
        page.wait_for_function("document.querySelectorAll('#sandboxes tbody tr').length === 1")
        page.fill("#search", "")
        page.wait_for_selector(f"#sandboxes tr[data-id='{sb.id}'] td:nth-child(5):has-text(' s')")
        screenshot(page, shots, "sandboxes")
        # an action asks first: cancelled, nothing happens; confirmed, it is done
        page.click(f"#sandboxes tr[data-id='{sb.id}'] button[data-action=pause]")
        page.click("#confirm button[value=cancel]")
        assert alpha.get(sb.id).state == "running"
        page.click(f"#sandboxes tr[data-id='{sb.id}'] button[data-action=pause]")
        page.click("#confirm-ok")
        page.wait_for_selector(f"#sandboxes tr[data-id='{sb.id}'][data-state=paused]")
        assert alpha.get(sb.id).state == "paused"
    finally:
        sb.delete()
    page.wait_for_selector(f"#sandboxes tr[data-id='{sb.id}']", state="detached")


def test_terminal(page: Any, box: Sandbox, shots: Path) -> None:
    page.goto(page.url.split("#")[0] + f"#/sandboxes/{box.id}/terminal")
    page.wait_for_selector("#terminal-status:has-text('connected')")
    page.click("#terminal")
    page.keyboard.type("echo hi\n")
    wait_line(page, "hi")
    page.keyboard.type("echo héllo ✓\n")  # UTF-8 both ways
    wait_line(page, "héllo ✓")
    assert not sleeping(box)
    page.keyboard.type("sleep 600; echo not-interrupted\n")
    eventually(lambda: sleeping(box), "the terminal's sleep runs")  # the control
    page.keyboard.press("Control+C")
    eventually(lambda: not sleeping(box), "Ctrl-C ends the sleep", timeout=10)
    page.keyboard.type("echo rc=$?\n")
    screen = wait_line(page, "rc=130")  # the shell saw SIGINT end the sleep
    assert "not-interrupted" not in screen
    before = stty_size(page, "before")
    page.set_viewport_size({"width": 900, "height": 600})
    asked = itertools.count()  # each ask echoes a new tag, so its answer is told apart
    eventually(  # the guest's PTY resized
        lambda: stty_size(page, f"after{next(asked)}") != before, "the PTY takes the new size"
    )
    page.set_viewport_size({"width": WIDTH, "height": HEIGHT})
    page.keyboard.type("clear; ls / | head -5; echo hi\n")
    wait_line(page, "hi")
    screenshot(page, shots, "terminal")


def wait_lines_matching(page: Any, pattern: str, timeout: float = 20.0) -> list[str]:
    import re

    shown = f"p => {ROWS}.some(line => new RegExp(`^(?:${{p}})$`).test(line))"
    try:
        page.wait_for_function(shown, arg=pattern, timeout=timeout * 1000)
    except PlaywrightTimeout:
        raise AssertionError(f"no line like {pattern!r}:\n" + "\n".join(rows_text(page))) from None
    return [line for line in rows_text(page) if re.fullmatch(pattern, line)]


def stty_size(page: Any, tag: str) -> list[str]:
    """The terminal's size as the guest's PTY has it: `stty size`, echoed after `tag`."""
    page.keyboard.type(f"echo {tag} $(stty size)\n")
    (line,) = wait_lines_matching(page, rf"{tag} \d+ \d+")
    return line.split()[1:]


def test_files(page: Any, box: Sandbox, shots: Path) -> None:
    box.files.write("/srv/readme.txt", "made by the SDK\n", parents=True)
    page.goto(page.url.split("#")[0] + f"#/sandboxes/{box.id}/files")
    page.wait_for_selector("a[data-path='/srv'][data-kind=dir]")
    page.fill("#files-path", "/srv")
    page.press("#files-path", "Enter")
    page.click("a[data-path='/srv/readme.txt']")
    assert page.inner_text("#viewer pre") == "made by the SDK\n"
    payload = "uploaded in the browser ✓\n".encode() + bytes(range(256))
    page.set_input_files(
        "#upload",
        files=[{"name": "up.bin", "mimeType": "application/octet-stream", "buffer": payload}],
    )
    page.wait_for_selector("a[data-path='/srv/up.bin']")
    assert box.files.read("/srv/up.bin") == payload  # in the guest, byte for byte
    with page.expect_download() as got:  # and back to the browser
        page.click("#files tr:has(a[data-path='/srv/up.bin']) button:has-text('download')")
    assert Path(got.value.path()).read_bytes() == payload
    screenshot(page, shots, "files")


def test_trace_follows_a_command_run_through_the_sdk(page: Any, box: Sandbox, shots: Path) -> None:
    page.goto(page.url.split("#")[0] + f"#/sandboxes/{box.id}/trace")
    page.wait_for_selector("#timeline li[data-type=created]")
    marker = f"traced-{time.time_ns()}"
    assert not page.query_selector(f"#timeline li:has-text('{marker}')")
    box.exec(f"echo {marker}; exit 3")
    item = page.wait_for_selector(f"#timeline li[data-type=exec]:has-text('echo {marker}')")
    assert "exit 3" in item.inner_text()
    page.uncheck("input[data-group=lifecycle]")  # filtering by type
    assert not page.is_visible("#timeline li[data-type=created]")
    assert item.is_visible()
    page.check("input[data-group=lifecycle]")
    screenshot(page, shots, "trace")


def test_a_command_opens_to_its_process_tree(page: Any, box: Sandbox, shots: Path) -> None:
    page.goto(page.url.split("#")[0] + f"#/sandboxes/{box.id}/trace")
    marker = f"tree-{time.time_ns()}"
    box.exec(["/bin/sh", "-c", f"ls / | wc -l; echo {marker}; exit 3"])
    item = page.wait_for_selector(f"#timeline li[data-type=exec]:has-text('{marker}')")
    item.query_selector("details.procs summary").click()  # type: ignore[union-attr]
    root = page.wait_for_selector(".proctree > li")
    assert root is not None and "exit 3" in root.inner_text()
    children = [li.inner_text() for li in root.query_selector_all(":scope > ul > li")]
    assert any(" ls /" in c and "exit 0" in c for c in children)
    assert any(" wc -l" in c and "exit 0" in c for c in children)
    screenshot(page, shots, "trace-processes")


def test_a_command_is_followed_by_the_files_it_changed(
    page: Any, box: Sandbox, shots: Path
) -> None:
    page.goto(page.url.split("#")[0] + f"#/sandboxes/{box.id}/trace")
    name = f"made-{time.time_ns()}"
    box.exec(["/bin/sh", "-c", f"printf 12345 > /root/{name}; cat /etc/hostname > /dev/null"])
    item = page.wait_for_selector(f"#timeline li[data-type=file_changes]:has-text('{name}')")
    assert item is not None
    item.query_selector("details.changes summary").click()  # type: ignore[union-attr]
    rows = [li.inner_text() for li in item.query_selector_all("ul[aria-label='File changes'] li")]
    assert any(f"/root/{name}" in r and "created" in r and "5 B" in r for r in rows), rows
    assert not any("/etc/hostname" in r for r in rows)  # read only: not a change
    screenshot(page, shots, "trace-files")


def test_lineage_of_a_snapshot_forked_three_times(
    page: Any, alpha: Client, box: Sandbox, shots: Path
) -> None:
    snap = box.snapshot("console")
    branches = snap.fork(3)
    try:
        page.goto(page.url.split("#")[0] + f"#/sandboxes/{box.id}/lineage")
        page.wait_for_selector("#lineage")
        forks = page.eval_on_selector_all(
            f"#lineage a.node[data-parent='{snap.id}']", "nodes => nodes.map(n => n.dataset.id)"
        )
        assert sorted(forks) == sorted(b.id for b in branches)
        assert page.query_selector(f"#lineage a.node[data-id='{snap.id}'][data-parent='{box.id}']")
        screenshot(page, shots, "lineage")
        page.goto(page.url.split("#")[0] + "#/snapshots")
        page.wait_for_selector(f"#snapshots tr[data-id='{snap.id}']")
        screenshot(page, shots, "snapshots")
        page.goto(page.url.split("#")[0] + f"#/sandboxes/{box.id}/lineage")
        page.wait_for_selector("#lineage")
        page.click(f"#lineage a.node[data-id='{snap.id}']")  # a snapshot: its row, focused
        page.wait_for_selector(f"#snapshots tr.highlight[data-id='{snap.id}']")
        assert page.evaluate("document.activeElement.dataset.id") == snap.id
        page.go_back()
        page.wait_for_selector("#lineage")
        page.click(f"#lineage a.node[data-id='{branches[0].id}']")  # click through to a node
        page.wait_for_selector(f"h1:has-text('{branches[0].id}')")
    finally:
        for b in branches:
            b.delete()


def test_eval_run_marks_the_failing_task(
    page: Any, daemon: Daemon, keys: dict[str, str], box: Sandbox, tmp_path: Path, shots: Path
) -> None:
    snap = box.snapshot("eval-base")
    tasks = [
        Task(id="passes", check="test 1 -eq 1"),
        Task(id="fails", commands=["echo trying"], check="echo 'expected 2, got 3'; exit 1"),
    ]
    with ThreadPoolExecutor(1) as pool:  # the eval's own event loop, beside Playwright's
        results = pool.submit(
            run_eval,
            tasks,
            snap.id,
            parallel=2,
            out_dir=tmp_path / "nightly",
            url=daemon.url,
            api_key=keys["alpha"],
        ).result()
    assert [r.passed for r in results] == [True, False]
    page.goto(page.url.split("#")[0] + "#/evals")
    page.click("#evals a:has-text('nightly')")
    page.wait_for_selector("#results")
    assert page.get_attribute("#results tr[data-task=fails]", "data-result") == "fail"
    assert "FAIL" in page.inner_text("#results tr[data-task=fails]")
    assert page.get_attribute("#results tr[data-task=passes]", "data-result") == "pass"
    screenshot(page, shots, "eval-run")
    page.click("#results tr[data-task=fails] a:has-text('trace')")  # the task's trace
    page.wait_for_selector("#timeline li[data-type=exec]:has-text('expected 2, got 3')")
    page.goto(page.url.split("#")[0] + "#/evals")
    page.wait_for_selector("#evals")
    screenshot(page, shots, "evals")
    # the lineage shows the branches' scores
    page.goto(page.url.split("#")[0] + f"#/sandboxes/{box.id}/lineage")
    failed = results[1].sandbox_id
    assert page.wait_for_selector(f"#lineage a.node.fail[data-id='{failed}']")
    screenshot(page, shots, "lineage-eval")


def test_another_tenant_sees_none_of_it(
    browser: Any, page: Any, daemon: Daemon, keys: dict[str, str], box: Sandbox
) -> None:
    page.goto(page.url.split("#")[0] + "#/sandboxes")
    page.wait_for_selector(f"#sandboxes tr[data-id='{box.id}']")  # control: alpha sees it
    with daemon.client(keys["beta"]) as beta, beta.create() as theirs:
        other = logged_in(browser, daemon, keys["beta"])
        try:
            other.wait_for_selector(f"#sandboxes tr[data-id='{theirs.id}']")  # loaded
            assert other.inner_text("#who") == "beta"
            rows = "rows => rows.map(r => r.dataset.id)"
            assert other.eval_on_selector_all("#sandboxes tbody tr", rows) == [theirs.id]
            other.goto(other.url.split("#")[0] + f"#/sandboxes/{box.id}")
            assert "no sandbox" in other.wait_for_selector("#toast.show").inner_text()
            other.goto(other.url.split("#")[0] + "#/evals")
            other.wait_for_selector("main p:has-text('No eval runs yet')")
        finally:
            other.context.close()


def test_changes_need_the_csrf_token(page: Any, daemon: Daemon, box: Sandbox) -> None:
    request = page.context.request  # the browser's cookie jar
    session = request.get(f"{daemon.url}/ui/session").json()
    refused = request.post(f"{daemon.url}/v1/sandboxes/{box.id}/pause")
    assert refused.status == 403 and "CSRF" in refused.json()["error"]["message"]
    forged = request.post(
        f"{daemon.url}/v1/sandboxes/{box.id}/pause", headers={"x-csrf-token": "forged"}
    )
    assert forged.status == 403
    assert request.get(f"{daemon.url}/v1/sandboxes/{box.id}").json()["state"] == "running"
    paused = request.post(  # control: the page's own token works
        f"{daemon.url}/v1/sandboxes/{box.id}/pause", headers={"x-csrf-token": session["csrf"]}
    )
    assert paused.status == 200 and paused.json()["state"] == "paused"
    resumed = request.post(
        f"{daemon.url}/v1/sandboxes/{box.id}/resume", headers={"x-csrf-token": session["csrf"]}
    )
    assert resumed.json()["state"] == "running"
    # reads need no token; a terminal WebSocket needs it, and this origin
    cookie = next(c for c in page.context.cookies() if c["name"] == "cella_session")
    ws_url = daemon.url.replace("http", "ws") + f"/v1/sandboxes/{box.id}/terminal"
    headers = {"cookie": f"cella_session={cookie['value']}", "origin": daemon.url}
    assert ws_refusal(ws_url, headers) == 4403
    assert ws_refusal(f"{ws_url}?csrf=forged", headers) == 4403
    evil = {**headers, "origin": "http://evil.test"}
    assert ws_refusal(f"{ws_url}?csrf={session['csrf']}", evil) == 4403
    assert ws_refusal(f"{ws_url}?csrf={session['csrf']}", headers) is None  # control


def ws_refusal(url: str, headers: dict[str, str]) -> int | None:
    """The close code (4000 + HTTP status) the daemon refuses a WebSocket with, or None
    when it opens."""
    from websockets.exceptions import ConnectionClosed, InvalidStatus
    from websockets.sync.client import connect

    try:
        with connect(url, additional_headers=headers, open_timeout=20) as ws:
            ws.recv(timeout=20)  # the shell's first output, or the refusal
            return None
    except ConnectionClosed as exc:
        return exc.rcvd.code if exc.rcvd else -1
    except InvalidStatus as exc:
        return exc.response.status_code


def test_host_page(browser: Any, daemon: Daemon, box: Sandbox, shots: Path) -> None:
    page = logged_in(browser, daemon, daemon.admin_key)
    try:
        page.goto(page.url.split("#")[0] + "#/host")
        text = page.wait_for_selector("#health").inner_text()
        assert "running on 127.0.0.1:" in text  # the egress proxy
        capacity = page.wait_for_selector("#capacity").inner_text()
        with httpx2.Client() as http:
            cap = http.get(
                f"{daemon.url}/v1/capacity", headers={"authorization": f"Bearer {daemon.admin_key}"}
            ).json()
        assert f"of {cap['memory_mib']} MiB committed" in capacity
        screenshot(page, shots, "host")
        # an admin sees every tenant's sandboxes (alpha's among them)
        page.goto(page.url.split("#")[0] + "#/sandboxes")
        page.wait_for_selector("#sandboxes tbody tr")
        assert "alpha" in page.inner_text("#sandboxes")
        # and works in it: alpha's sandbox's terminal, opened from the admin's list
        page.click(f"#sandboxes a[href*='{box.id}']")
        page.wait_for_selector(f"h1:has-text('{box.id}')")
        page.click("nav.tabs a:has-text('terminal')")
        page.wait_for_selector("#terminal-status:has-text('connected')")
        page.click("#terminal")
        page.keyboard.type("echo admin-$((40+2))\n")
        wait_line(page, "admin-42")
    finally:
        page.context.close()


def test_sandbox_overview(page: Any, box: Sandbox, shots: Path) -> None:
    page.goto(page.url.split("#")[0] + f"#/sandboxes/{box.id}")
    page.wait_for_selector("table.kv caption:has-text('Usage')")
    page.wait_for_selector("table.kv td:has-text(' of ')")
    assert "team=console" in page.inner_text("#tab")
    screenshot(page, shots, "sandbox")
    assert json.dumps(page.evaluate("typeof window.Terminal")) == '"function"'


def test_the_access_form_shares_and_unshares(
    page: Any, browser: Any, daemon: Daemon, admin: Client, box: Sandbox, shots: Path
) -> None:
    """A key that manages the sandbox shares it from its overview: a principal added with a
    permission, the visibility chosen, saved; later unshared. A principal the API refuses
    changes nothing and says why. The key it is shared with sees who may use it, and no
    form (the control: the form is there for the key that manages it)."""
    before = box.access()
    page.goto(page.url.split("#")[0] + f"#/sandboxes/{box.id}")
    page.reload()  # drawn afresh, whatever the page showed before
    page.wait_for_selector("#access tbody td:has-text('shared with no one')")
    page.fill("#share-principal", "console-viewer")
    page.select_option("#share-level", "view")
    page.click("#access button:has-text('Add')")
    page.select_option("#visibility", "private")
    page.click("#access button[type=submit]")
    eventually(lambda: box.access().shares == {"console-viewer": "view"}, "the share saved")
    assert box.access().visibility == "private"
    page.wait_for_selector("table.kv td:has-text('console-viewer (view)')")  # drawn again
    screenshot(page, shots, "access")

    page.fill("#share-principal", "no spaces allowed")
    page.click("#access button[type=submit]")
    page.wait_for_selector("#toast.show.bad")
    assert box.access().shares == {"console-viewer": "view"}  # nothing changed

    viewer = admin.create_key("alpha", principal="console-viewer", roles=["member"])["key"]
    theirs = logged_in(browser, daemon, viewer)
    try:
        theirs.goto(theirs.url.split("#")[0] + f"#/sandboxes/{box.id}")
        theirs.wait_for_selector("table.kv td:has-text(' of ')")
        assert "console-viewer (view)" in theirs.inner_text("table.kv")
        assert theirs.locator("#access").count() == 0 and page.locator("#access").count() == 1
    finally:
        theirs.context.close()

    page.reload()  # what is saved, not what the refused form held
    page.wait_for_selector("#access tr[data-principal='console-viewer']")
    assert page.locator("#access tr[data-principal='no spaces allowed']").count() == 0
    page.click("#access button[aria-label='Unshare console-viewer']")
    page.select_option("#visibility", before.visibility)
    page.click("#access button[type=submit]")
    eventually(lambda: box.access().shares == {}, "the share taken back")
    assert box.access().visibility == before.visibility
    page.wait_for_selector("#access tbody td:has-text('shared with no one')")


def test_eval_runs_api_refuses_bad_input(
    daemon: Daemon, keys: dict[str, str], alpha: Client, box: Sandbox
) -> None:
    from cella.models.evals import EvalResult

    snap = box.snapshot("eval-api")
    run = alpha.create_eval_run("eval-api", 2, name="api")  # a name resolves to the id
    assert run.snapshot_id == snap.id and run.tasks == 2
    with httpx2.Client(base_url=daemon.url) as http:

        def call(method: str, path: str, key: str = keys["alpha"], **kw: Any) -> Any:
            return http.request(method, path, headers={"authorization": f"Bearer {key}"}, **kw)

        result = {"task_id": "t1", "passed": True, "score": 1.0}
        assert call("PUT", f"/v1/evals/{run.id}/results/t1", json=result).status_code == 200
        assert call("PUT", f"/v1/evals/{run.id}/results/t2", json=result).status_code == 400
        assert call("PUT", f"/v1/evals/{run.id}/results/-bad%20id", json=result).status_code == 400
        bad = call("PUT", f"/v1/evals/{run.id}/results/t1", json={**result, "score": "x"})
        assert bad.status_code == 400
        nan = http.put(
            f"/v1/evals/{run.id}/results/t1",
            content=b'{"task_id": "t1", "score": NaN}',
            headers={
                "authorization": f"Bearer {keys['alpha']}",
                "content-type": "application/json",
            },
        )
        assert nan.status_code == 400
        with daemon.client(keys["beta"]) as beta, beta.create() as theirs:
            borrowed = {**result, "sandbox_id": theirs.id}  # a score on beta's lineage
            claim = call("PUT", f"/v1/evals/{run.id}/results/t1", json=borrowed)
            assert claim.status_code == 404
            assert beta.get(theirs.id).lineage().eval is None
        mine = call("PUT", f"/v1/evals/{run.id}/results/t1", json={**result, "sandbox_id": box.id})
        assert mine.status_code == 200  # the control: its own sandbox
        assert call("PUT", "/v1/evals/ev-nope/results/t1", json=result).status_code == 404
        assert (
            call("POST", "/v1/evals", json={"snapshot_id": "snap-nope", "tasks": 1}).status_code
            == 404
        )
        assert (
            call("POST", "/v1/evals", json={"snapshot_id": snap.id, "tasks": -1}).status_code == 400
        )
        # another tenant neither sees nor writes the run
        assert call("GET", f"/v1/evals/{run.id}", keys["beta"]).status_code == 404
        assert (
            call("PUT", f"/v1/evals/{run.id}/results/t1", keys["beta"], json=result).status_code
            == 404
        )
        assert run.id not in call("GET", "/v1/evals", keys["beta"]).text
        assert run.id in call("GET", "/v1/evals").text  # control
    alpha.record_eval_result(run.id, EvalResult(task_id="t2", passed=False, error="it broke"))
    done = alpha.finish_eval_run(run.id)
    assert (done.passed, done.failed, done.errors) == (1, 0, 1) and done.finished_at
    with pytest.raises(errors.InvalidState, match="finished"):
        alpha.record_eval_result(run.id, EvalResult(task_id="t3"))
    assert [r.task_id for r in alpha.eval_run(run.id).results] == ["t1", "t2"]


# The guest's web server: any path echoes the request's headers; `/attack` is a page whose
# script shows that it ran, then tries to read the console's session (`?target=`, else
# `/ui/session` of its own origin) and shows what it got; it also sets cookies: one under
# the console's session name and one for the parent domain, beside an ordinary one.
ECHO_SERVER = '''
import http.server
ATTACK = """<!doctype html><title>attack</title><p id=ran></p><p id=stolen></p><script>
document.getElementById("ran").textContent = "ran";
const target = new URLSearchParams(location.search).get("target") || "/ui/session";
fetch(target, {credentials: "include"}).then(r => r.text(), () => "refused")
  .then(t => { document.getElementById("stolen").textContent = t; });
</script>"""
class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        attack = self.path.startswith("/attack")
        body = (ATTACK if attack else "<h1>served from the sandbox</h1><pre id=headers>"
                + str(self.headers).replace("<", "&lt;") + "</pre>").encode()
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(body)))
        if attack:
            self.send_header("set-cookie", "own=1; Path=/")
            self.send_header("set-cookie", "parent=planted; Domain=localhost; Path=/")
            self.send_header("set-cookie", "cella_session=planted; Path=/")
        self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(("127.0.0.1", 8000), Echo).serve_forever()
'''


@pytest.fixture(scope="module")
def web_server(box: Sandbox) -> int:
    """ECHO_SERVER on the box's port 8000, listening."""
    box.files.write("/srv/echo.py", ECHO_SERVER, parents=True)
    box.exec("nohup python3 /srv/echo.py >/dev/null 2>&1 &")
    listening = "import socket; socket.create_connection(('127.0.0.1', 8000))"
    eventually(lambda: box.exec(["python3", "-c", listening]).exit_code == 0, "8000 listens")
    return 8000


def test_a_port_opens_in_a_new_tab(page: Any, box: Sandbox, web_server: int) -> None:
    """Through a service URL, in a page that cannot act as the console: the guest's server
    never gets the session cookie, and the page runs in an opaque origin."""
    page.goto(page.url.split("#")[0] + f"#/sandboxes/{box.id}")
    page.fill("#port", str(web_server))
    with page.context.expect_page() as opened:
        page.click("button:has-text('Open port')")
    tab = opened.value
    tab.wait_for_url("**/v1/services/**")
    tab.wait_for_load_state()
    assert tab.inner_text("h1") == "served from the sandbox"
    assert "/v1/services/" in tab.url
    seen = tab.inner_text("#headers").lower()
    assert "user-agent" in seen  # the control: the browser's headers reach the guest
    assert "cella_session" not in seen and "cella_service_" not in seen
    assert tab.evaluate("window.origin") == "null"  # sandboxed: not the daemon's origin
    stolen = tab.evaluate(
        "fetch('/ui/session', {credentials: 'include'}).then(r => r.text(), e => 'refused')"
    )
    assert stolen == "refused"
    tab.close()


def test_a_guest_page_cannot_take_over_the_console(
    page: Any, daemon: Daemon, box: Sandbox, web_server: int
) -> None:
    """A logged-in console opens a guest's page (a link with a service token, as an
    attacker would send it) by the host path on the daemon's own host, and by the port's
    host name. Its script runs (the control) but reads no session nor CSRF token, and its
    cookies neither replace the console's session nor reach a parent domain; the console's
    own origin does read the session (the control for the read)."""
    mine = page.evaluate("fetch('/ui/session').then(r => r.json())")
    assert mine["tenant"] == "alpha" and mine["csrf"]  # the control: the origin reads it
    session = [c for c in page.context.cookies() if c["name"] == "cella_session"]
    token = box.expose(web_server).token
    host = f"{web_server}-{box.id}.localhost"
    by_path = f"{daemon.url}/v1/hosts/{box.id}/{web_server}/attack?cella_token={token}"
    by_name = f"http://{host}:{daemon.port}/attack?cella_token={token}"
    for url, origin in (
        (by_path, "null"),  # sandboxed: an opaque origin
        (f"{by_name}&target={daemon.url}/ui/session", f"http://{host}:{daemon.port}"),
    ):
        tab = page.context.new_page()
        tab.goto(url)
        tab.wait_for_selector("#stolen:not(:empty)")
        assert tab.inner_text("#ran") == "ran", url  # the control: its script runs
        assert tab.inner_text("#stolen") == "refused", url
        assert tab.evaluate("window.origin") == origin, url
        tab.close()
    cookies = page.context.cookies()
    on_console = [c for c in cookies if c["domain"] == "127.0.0.1" and c["name"] == "cella_session"]
    assert on_console == session  # the console's session cookie, untouched
    planted = {c["domain"] for c in cookies if c["name"] == "cella_session"} - {"127.0.0.1"}
    assert planted == {host}  # host-only on the guest's own host name: never sent to the console
    assert not [c for c in cookies if c["name"] == "parent"]  # no parent domain's cookie
    own = {(c["domain"], c["path"]) for c in cookies if c["name"] == "own"}
    assert own == {("127.0.0.1", f"/v1/hosts/{box.id}/{web_server}/"), (host, "/")}  # control
    assert page.evaluate("fetch('/ui/session').then(r => r.json())") == mine  # still its own


def test_secret_values_are_never_rendered(
    page: Any, alpha: Client, daemon: Daemon, keys: dict[str, str]
) -> None:
    value = f"s3cr3t-{time.time_ns()}"
    alpha.put_secret("console-token", value, ["api.test"])
    sb = alpha.create(secrets={"API_TOKEN": "console-token"})
    try:
        sb.exec("echo token is $API_TOKEN")  # the trace holds the placeholder, redacted
        seen = []
        for tab, shown in (
            ("", "#tab td:has-text('console-token')"),
            ("/trace", "#timeline li[data-type=exec]:has-text('[secret:console-token]')"),
        ):
            page.goto(page.url.split("#")[0] + f"#/sandboxes/{sb.id}{tab}")
            page.wait_for_selector(shown)
            painted(page)
            seen.append(page.content())
        assert "console-token" in seen[0]  # the control: the secret's name is shown
        assert "[secret:console-token]" in seen[1]
        assert not any(value in html for html in seen)
    finally:
        sb.delete()


def test_every_control_has_a_label(page: Any, alpha: Client, box: Sandbox) -> None:
    unlabelled = """() => [...document.querySelectorAll('input, select, button, textarea')]
        .filter(el => !(el.labels && el.labels.length) && !el.getAttribute('aria-label')
                      && !el.textContent.trim() && el.type !== 'hidden')
        .map(el => el.outerHTML)"""
    snap = box.snapshot("labels")  # a row of controls in the snapshots view
    for view, loaded in (
        ("#/sandboxes", f"#sandboxes tr[data-id='{box.id}']"),
        (f"#/sandboxes/{box.id}", "table.kv td:has-text(' of ')"),
        (f"#/sandboxes/{box.id}/files", "#files a[data-path='/etc']"),
        (f"#/sandboxes/{box.id}/trace", "#timeline li[data-type=created]"),
        ("#/snapshots", f"#snapshots tr[data-id='{snap.id}']"),
        ("#/evals", "#evals tbody tr, main p:has-text('No eval runs yet')"),
    ):
        page.goto(page.url.split("#")[0] + view)
        page.wait_for_selector(loaded)
        assert page.evaluate(unlabelled) == [], view
    page.goto(page.url.split("#")[0] + "#/sandboxes")  # and the keyboard reaches the list
    page.wait_for_selector("#sandboxes tbody tr")
    page.focus("#search")
    for _ in range(4):  # the state filter, New sandbox, the first row's link, its first action
        page.keyboard.press("Tab")
    on_row = "document.activeElement.closest('#sandboxes tbody tr')?.dataset.id ?? null"
    focused = page.evaluate(on_row)
    assert focused is not None
    control = page.evaluate("document.activeElement.outerHTML")
    other = alpha.create(name="redraws-the-list")  # a new row redraws the list under the keyboard
    try:
        page.wait_for_selector(f"#sandboxes tr[data-id='{other.id}']")
        assert page.evaluate(on_row) == focused
        assert page.evaluate("document.activeElement.outerHTML") == control
    finally:
        other.delete()


def test_checkpoints_tab_diffs_and_rewinds(page: Any, box: Sandbox, shots: Path) -> None:
    """The sandbox page lists its checkpoints; one is diffed against now (the changed file
    listed with its text diff) and the sandbox rewound to it, confirmed first."""
    box.files.write("/root/console-note.txt", "before\n")
    cp = box.checkpoint("console-cp")
    box.files.write("/root/console-note.txt", "after\n")
    page.goto(page.url.split("#")[0] + f"#/sandboxes/{box.id}/checkpoints")
    row = f"#checkpoints tr[data-name='{cp.name}']"
    page.wait_for_selector(row)
    page.click(f"{row} button[data-action=diff]")
    changed = page.wait_for_selector("#diff li[data-path='/root/console-note.txt']")
    assert changed.get_attribute("data-change") == "modified"
    text = page.eval_on_selector(
        "#diff li[data-path='/root/console-note.txt'] pre", "el => el.textContent"
    )
    assert "-before\n+after\n" in text
    screenshot(page, shots, "checkpoints")
    page.click(f"{row} button[data-action=rewind]")
    page.click("#confirm-ok")

    def rewound() -> bool:
        try:
            return box.files.read("/root/console-note.txt") == b"before\n"
        except errors.CellaError:  # still restoring
            return False

    eventually(rewound, "the rewind")
