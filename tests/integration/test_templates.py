"""Template builds: cached by content hash; a failed build leaves nothing in the cache."""

from __future__ import annotations

import time

import pytest

from cella import errors
from cella.images.templates import TemplateSpec, build_template, builtin_templates, template_image
from cella.paths import Paths

pytestmark = pytest.mark.vm


def test_unchanged_template_is_never_rebuilt(paths: Paths) -> None:
    spec = builtin_templates()["default"]
    image = template_image(paths, spec)
    assert image.exists(), "cella setup builds the default template"
    mtime = image.stat().st_mtime_ns
    lines: list[str] = []
    start = time.monotonic()
    assert build_template(paths, spec, lines.append) == image
    assert time.monotonic() - start < 5
    assert image.stat().st_mtime_ns == mtime
    assert any("up to date" in line for line in lines)
    assert not any("debootstrap" in line for line in lines)
    # the base is read-only: sandboxes write to overlays only
    assert image.stat().st_mode & 0o222 == 0


def test_failed_build_leaves_no_image(paths: Paths) -> None:
    spec = TemplateSpec(name="broken", apt_packages=["cella-no-such-package-xyz"])
    before = set(paths.templates.iterdir())
    tmp_before = set(paths.build_tmp.iterdir())
    lines: list[str] = []
    with pytest.raises(errors.BuildFailed):
        build_template(paths, spec, lines.append)
    assert lines, "the build reports progress"
    assert not template_image(paths, spec).exists()
    assert set(paths.templates.iterdir()) == before
    assert set(paths.build_tmp.iterdir()) == tmp_before
