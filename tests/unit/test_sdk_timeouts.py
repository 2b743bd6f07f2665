"""How long the SDK waits: a request that runs a command waits as long as the command may."""

from __future__ import annotations

from cella.sdk._base import COMMAND_MARGIN, command_wait


def test_a_command_request_waits_for_the_command() -> None:
    wait = command_wait(2.0, 1800.0)
    assert wait.read == 1800.0 + COMMAND_MARGIN  # not the client's 2 s
    assert (wait.connect, wait.write, wait.pool) == (10.0, 2.0, 2.0)  # the rest as before
    assert command_wait(2.0, None).read is None  # no command timeout: no read limit
    assert command_wait(900.0, 5.0).read == 900.0  # never less than the client's own
