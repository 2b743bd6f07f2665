"""The screen of a desktop sandbox: a PNG of its X display, taken in the guest.

A sandbox has a desktop when its guest has `scrot` and an X display on :0 (the `desktop`
template, a fork or snapshot of one, or an image of the user's with both). The display is
started again (`start-desktop`) when it is not up, e.g. after a stop and a fresh boot. The
PNG comes from the guest, so it is bounded and checked to be a PNG before anyone sees it.
"""

from __future__ import annotations

import struct

from cella import errors
from cella.models import ExecRequest
from cella.policy.access import Principal
from cella.service.exec import Exec

DISPLAY = ":0"
MAX_PNG = 32 << 20  # a 4K screen of noise is ~25 MiB
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NO_SCROT, NO_DISPLAY = 64, 65  # exit codes of SHOT that mean "not a desktop"
NOT_STARTED = 66  # the desktop's own start failed (its output in stderr)
SHOT = f"""
command -v scrot >/dev/null || exit {NO_SCROT}
if ! xdpyinfo -display {DISPLAY} >/dev/null 2>&1; then
    command -v start-desktop >/dev/null || exit {NO_DISPLAY}
    # /tmp is on the disk: a display's lock from before a stop would refuse the new one
    pgrep -x Xvfb >/dev/null || rm -f /tmp/.X0-lock /tmp/.X11-unix/X0
    start-desktop >&2 || exit {NOT_STARTED}
fi
f=$(mktemp -u /tmp/screen-XXXXXX.png) || exit 1
scrot "$f" >&2 && cat "$f"
s=$?
rm -f "$f"
exit $s
"""


class Desktop:
    def __init__(self, exec_room: Exec) -> None:
        self.exec = exec_room

    async def screenshot(self, who: Principal, sandbox_id: str) -> bytes:
        """A PNG of the sandbox's screen; InvalidState if it has no desktop."""
        req = ExecRequest(command=SHOT, user="root", env={"DISPLAY": DISPLAY}, timeout=120)
        # looking is not using: a console showing the screen keeps no sandbox from idling
        done = await self.exec.run(who, sandbox_id, req, keep=MAX_PNG, activity=False)
        if done.exit_code in (NO_SCROT, NO_DISPLAY):
            what = "no screenshot tool (scrot)" if done.exit_code == NO_SCROT else "no X display"
            raise errors.InvalidState(
                f"sandbox {sandbox_id} has no desktop ({what}): create it from the "
                "`desktop` template"
            )
        stderr = done.stderr.decode(errors="replace").strip()[-1000:]
        if done.exit_code == NOT_STARTED:
            raise errors.GuestError(f"the desktop of {sandbox_id} did not start: {stderr}")
        if done.exit_code != 0:
            raise errors.GuestError(f"the screenshot failed ({done.exit_code}): {stderr}")
        if done.stdout_truncated:
            raise errors.PayloadTooLarge(f"the screenshot is over {MAX_PNG >> 20} MiB")
        png = done.stdout
        if not png.startswith(PNG_SIGNATURE) or png_size(png) is None:
            raise errors.GuestError("the sandbox's screenshot is not a PNG")
        return png


def png_size(png: bytes) -> tuple[int, int] | None:
    """Width and height from a PNG's header (its first chunk, IHDR), or None."""
    if len(png) < 24 or png[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", png[16:24])
    return (width, height) if width and height else None
