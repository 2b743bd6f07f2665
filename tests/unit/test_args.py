from pathlib import Path

from cella.runtime.qemu.args import VMConfig, host_tsc_khz, kernel_cmdline, qemu_argv


def config(accel: str = "tcg") -> VMConfig:
    return VMConfig(
        name="vm-x",
        vcpus=2,
        memory_mib=512,
        kernel=Path("/k"),
        initrd=Path("/i"),
        disk=Path("/d.qcow2"),
        qmp_socket=Path("/q.sock"),
        agent_socket=Path("/a.sock"),
        console_log=Path("/c.log"),
        accel=accel,  # type: ignore[arg-type]
    )


def test_tsc_khz_from_cpuinfo() -> None:
    assert host_tsc_khz("model name\t: x\ncpu MHz\t\t: 2000.000\n") == 2_000_000
    assert host_tsc_khz("no rate here") is None


def test_tcg_cmdline_pins_tsc_and_kvm_keeps_hardening() -> None:
    tcg = kernel_cmdline("tcg", 2_000_000).split()
    assert "tsc_early_khz=2000000" in tcg and "norandmaps" in tcg
    kvm = kernel_cmdline("kvm", 2_000_000).split()
    assert not {"norandmaps", "mitigations=off", "init_on_alloc=0"} & set(kvm)
    assert "panic=-1" in kvm


def test_argv_shape() -> None:
    argv = qemu_argv(config("tcg"), 1000)
    joined = " ".join(argv)
    assert argv[argv.index("-machine") + 1] == "microvm,acpi=on,memory-backend=ram"
    # a booted VM's RAM has the name a snapshot helper's file-backed RAM has
    assert "memory-backend-ram,id=ram,size=512M" in joined
    assert argv[argv.index("-cpu") + 1] == "qemu64,+arat"
    assert argv[argv.index("-smp") + 1] == "2" and argv[argv.index("-m") + 1] == "512M"
    assert "-no-reboot" in argv and "-nodefaults" in argv
    assert "name=cella.agent" in joined and "file=/d.qcow2,format=qcow2" in joined
    assert qemu_argv(config("kvm"))[qemu_argv(config("kvm")).index("-cpu") + 1] == "host"


def test_socket_paths_stay_short_under_long_directories(tmp_path: Path) -> None:
    from cella.runtime.qemu.vm import VMFiles

    deep = tmp_path.joinpath(*["a-rather-long-directory-name"] * 8)
    files = VMFiles.under(deep)
    assert len(str(files.qmp_socket)) < 108 and len(str(files.agent_socket)) < 108
    assert VMFiles.under(deep) == files  # the same VM finds the same sockets again
    assert VMFiles.under(tmp_path) != files
    files.qmp_socket.parent.rmdir()
    VMFiles.under(tmp_path).qmp_socket.parent.rmdir()
