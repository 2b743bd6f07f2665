"""The web console at `/ui`: a static front end over the REST API.

The daemon serves the page, its scripts and styles, and three routes of its own: log in
(an API key in, a session cookie out), log out, and the session (who is logged in and the
CSRF token the page sends with every change). Everything else the page shows or does goes
through `/v1`, as any client would. Every `/ui` response carries a Content-Security-Policy
that allows scripts from this origin only (no inline script), and forbids framing.
"""

from __future__ import annotations

import contextlib
import html
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cella import errors
from cella.server.deps import CSRF_HEADER, SESSION_COOKIE
from cella.server.front import front_of
from cella.service.sessions import Sessions

STATIC = Path(__file__).parent / "static"
# xterm.js adds <style> elements for its cells: styles may be inline, scripts never. Images
# from blobs: a desktop sandbox's screenshot, fetched with the session and drawn as an image.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data: blob:; connect-src 'self'; font-src 'self'; object-src 'none'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",  # no-referrer would make form posts say `Origin: null`
    "x-frame-options": "DENY",
    "cache-control": "no-store",
}
MAX_LOGIN_BODY = 4096

router = APIRouter(prefix="/ui", include_in_schema=False)


def install(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/ui/static", StaticFiles(directory=STATIC), name="ui-static")
    app.add_middleware(SecurityHeaders)


class SecurityHeaders:
    """The console's headers on every `/ui` response, the static files' included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/ui"):
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message["headers"] if k.decode() not in HEADERS]
                headers += [(k.encode(), v.encode()) for k, v in HEADERS.items()]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


def _sessions(request: Request) -> Sessions:
    return front_of(request).sessions


def _logged_in(request: Request) -> bool:
    token = request.cookies.get(SESSION_COOKIE)
    if not token:
        return False
    try:
        _sessions(request).principal(token)
    except errors.CellaError:
        return False
    return True


@router.get("")
@router.get("/")
async def index(request: Request) -> Response:
    if not _logged_in(request):
        return RedirectResponse("/ui/login", status_code=303)
    return FileResponse(STATIC / "index.html", media_type="text/html")


@router.get("/login")
async def login_page() -> HTMLResponse:
    return HTMLResponse(_login_html(None))


@router.post("/login")
async def login(request: Request) -> Response:
    """Takes the key from the form; sets the session cookie (HttpOnly, SameSite=Strict).
    Only from this origin's own form: another site cannot log a browser into its tenant."""
    origin = request.headers.get("origin")
    if origin is not None and origin.partition("://")[2] != request.headers.get("host"):
        return HTMLResponse(_login_html("log in from this console's own page"), status_code=403)
    body = await request.body()
    if len(body) > MAX_LOGIN_BODY:
        return HTMLResponse(_login_html("the form is too large"), status_code=413)
    key = (parse_qs(body.decode(errors="replace")).get("key") or [""])[0].strip()
    try:
        token, who = _sessions(request).login(key)
    except errors.CellaError as exc:
        return HTMLResponse(_login_html(exc.message), status_code=exc.status)
    request.state.key_use = who  # the audit log of key use records the login
    response = RedirectResponse("/ui/", status_code=303)
    response.set_cookie(
        SESSION_COOKIE,
        token,
        max_age=int(_sessions(request).lifetime),
        path="/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    token = request.cookies.get(SESSION_COOKIE)
    if token:
        sessions = _sessions(request)
        sessions.check_csrf(token, request.headers.get(CSRF_HEADER))
        with contextlib.suppress(errors.Unauthenticated):  # already over
            sessions.logout(token)
    response = JSONResponse({"ok": True})
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
    return response


@router.get("/session")
async def session(request: Request) -> dict[str, Any]:
    """Who the session speaks for, and the CSRF token for the page's changes."""
    token = request.cookies.get(SESSION_COOKIE)
    if not token:
        raise errors.Unauthenticated("not logged in")
    sessions = _sessions(request)
    who = sessions.principal(token)
    return {
        "tenant": who.tenant,
        "admin": who.admin,
        "read_only": who.read_only,
        "key_id": who.key_id,
        "csrf": sessions.csrf_token(token),
    }


def _login_html(error: str | None) -> str:
    page = (STATIC / "login.html").read_text()
    message = f'<p class="error" role="alert">{html.escape(error)}</p>' if error else ""
    return page.replace("<!--error-->", message)
