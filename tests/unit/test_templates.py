from pathlib import Path

import pytest

from cella import errors
from cella.images import cpio
from cella.images.templates import TemplateSpec, builtin_templates


def test_digest_is_stable_and_sensitive() -> None:
    a = TemplateSpec(name="t", apt_packages=["git"])
    assert a.digest() == TemplateSpec(name="t", apt_packages=["git"]).digest()
    assert a.digest() != TemplateSpec(name="t", apt_packages=["git", "curl"]).digest()
    assert a.digest() != TemplateSpec(name="t", apt_packages=["git"], setup=["true"]).digest()


def test_default_template_is_declared_as_data() -> None:
    spec = builtin_templates()["default"]
    for pkg in ("python3", "python3-venv", "python3-pip", "git", "curl", "procps"):
        assert pkg in spec.apt_packages
    assert spec.suite == "bookworm"


def test_toml_spec_validation() -> None:
    spec = TemplateSpec.from_toml('name = "x"\npip_packages = ["requests"]\ndisk_mib = 1024\n')
    assert spec.pip_packages == ["requests"]
    with pytest.raises(ValueError, match="disk_mib"):
        TemplateSpec.from_toml('name = "x"\ndisk_mib = 10\n')


def test_unknown_template(tmp_path: Path) -> None:
    from cella.images.templates import find_template
    from cella.paths import Paths

    with pytest.raises(errors.NotFound):
        find_template(Paths(tmp_path), "no-such-template")
    with pytest.raises(errors.ImageMissing):
        find_template(Paths(tmp_path), "default")


def test_cpio_newc_layout() -> None:
    import io

    buf = io.BytesIO()
    cpio.write_newc(buf, [cpio.directory("d"), cpio.file("d/f", b"abc")])
    data = buf.getvalue()
    assert data.startswith(b"070701") and b"TRAILER!!!" in data
    assert len(data) % 4 == 0 and b"abc" in data


def test_a_builtin_template_carries_package_files_whole() -> None:
    """`files_from` puts a checked program of this package into the template (and so into
    its digest)."""
    spec = builtin_templates()["code-interpreter"]
    program = spec.files["/usr/local/bin/cella-interpreter"]
    source = Path(__file__).parents[2] / "src/cella/images/guest/interpreter.py"
    assert program == source.read_text()
    assert "python3-ipykernel" in spec.apt_install and spec.warm == ["start-interpreter"]
    changed = spec.model_copy(update={"files": {**spec.files, "/x": "y"}})
    assert changed.digest() != spec.digest()


def test_a_templates_shape_is_a_default_and_not_part_of_its_image() -> None:
    from cella.images.templates import default_shape

    plain = TemplateSpec(name="t", apt_packages=["git"])
    roomy = TemplateSpec(name="t", apt_packages=["git"], vcpus=2, memory_mib=2048)
    assert roomy.digest() == plain.digest()  # the same image, whatever the shape
    desktop = builtin_templates()["desktop"]
    assert default_shape("desktop") == {"memory_mib": 2048, "vcpus": 2}
    assert default_shape("default") == {} and default_shape("no-such") == {}
    for tool in ("xvfb", "xdotool", "scrot", "x11vnc", "novnc", "firefox-esr"):
        assert tool in desktop.apt_install  # what e2b-desktop runs in the sandbox
