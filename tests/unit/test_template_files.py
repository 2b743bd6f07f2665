"""Uploaded template files: a tenant's quota (413 past it, nothing kept lost, room again once
a sweep removed what no build needs), and the sweep keeping every file a running or ready
build names, and any file asked for or uploaded within the keep time."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cella import errors
from cella.service.template_files import TemplateFiles
from cella.store import NamedTemplateRecord, Store, TemplateBuildRecord

KiB = 1024
A, B, C = "a" * 64, "b" * 64, "c" * 64


async def body(size: int) -> AsyncIterator[bytes]:
    for _ in range(size // KiB):
        yield b"x" * KiB


def make(tmp_path: Path, quota: int = 100 * KiB, keep: float = 3600.0) -> TemplateFiles:
    store = Store(tmp_path / "cella.db")
    return TemplateFiles(
        store, tmp_path / "files", max_upload_bytes=80 * KiB, quota_bytes=quota, keep_seconds=keep
    )


def age(files: TemplateFiles, tenant: str, files_hash: str, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(files.path(tenant, files_hash), (then, then))


def test_an_upload_past_the_quota_is_refused_and_nothing_kept_is_lost(tmp_path: Path) -> None:
    files = make(tmp_path)
    asyncio.run(files.receive("t1", A, body(60 * KiB)))
    with pytest.raises(errors.PayloadTooLarge, match="quota of"):
        asyncio.run(files.receive("t1", B, body(60 * KiB)))
    assert files.present("t1", A) and not files.present("t1", B)
    assert files.used_bytes("t1") == 60 * KiB  # the refused upload left nothing behind
    # another tenant has a quota of its own (control: the same upload is taken)
    asyncio.run(files.receive("t2", B, body(60 * KiB)))
    assert files.present("t2", B) and not files.present("t1", B)
    # past the single upload limit, under the quota: refused by that limit
    with pytest.raises(errors.PayloadTooLarge, match="over 0 MiB"):
        asyncio.run(files.receive("t3", C, body(90 * KiB)))


def test_the_sweep_keeps_what_builds_need_and_recent_files(tmp_path: Path) -> None:
    files = make(tmp_path)
    store = files.store
    store.add_named_template(NamedTemplateRecord("tpl1", "t1", "web"))
    steps = [{"type": "copy", "args": ["site", "/srv"], "files_hash": A}]
    store.insert_build(
        TemplateBuildRecord("b1", "tpl1", "t1", state="ready", spec=json.dumps({"steps": steps}))
    )
    failed = [{"type": "copy", "args": ["x", "/x"], "files_hash": B}]
    store.insert_build(
        TemplateBuildRecord("b2", "tpl1", "t1", state="error", spec=json.dumps({"steps": failed}))
    )
    for h in (A, B, C):
        asyncio.run(files.receive("t1", h, body(KiB)))
    asyncio.run(files.receive("t2", A, body(KiB)))  # another tenant's file of the same hash
    assert files.sweep() == 0  # all fresh
    for tenant, h in (("t1", A), ("t1", B), ("t2", A)):
        age(files, tenant, h, 7200)
    assert files.sweep() == 2  # t1's B (its build failed) and t2's A (no build of t2's)
    assert files.present("t1", A)  # a ready build names it: a build on that one repeats it
    assert files.present("t1", C)  # uploaded within the keep time
    assert not files.present("t1", B) and not files.present("t2", A)


def test_asking_for_a_file_keeps_it_longer(tmp_path: Path) -> None:
    files = make(tmp_path)
    asyncio.run(files.receive("t1", A, body(KiB)))
    age(files, "t1", A, 7200)
    assert files.present("t1", A)  # a client about to start a build that names it
    assert files.sweep() == 0 and files.present("t1", A)
    age(files, "t1", A, 7200)
    assert files.sweep() == 1


def test_a_full_quota_is_swept_before_an_upload_is_refused(tmp_path: Path) -> None:
    files = make(tmp_path)
    asyncio.run(files.receive("t1", A, body(60 * KiB)))
    asyncio.run(files.receive("t1", B, body(30 * KiB)))
    age(files, "t1", A, 7200)
    asyncio.run(files.receive("t1", C, body(20 * KiB)))  # room made: A was no one's
    assert not files.present("t1", A) and files.present("t1", C)
