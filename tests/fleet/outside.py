"""What a fleet's sandboxes reach outside it, started before the cluster (its nodes are
told where): a TLS registry behind htpasswd holding a busybox image, a web server that
echoes what it gets, a proxy callback that answers as it is told, a private git
repository over HTTPS that wants a token, and moto's S3 checking every Signature V4."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.integration.test_langsmith import CallbackHandler
from tests.netservers import (
    EchoHandler,
    GitHandler,
    Recorder,
    Servers,
    TestCA,
    free_loopback_block,
    moto_key,
    start_moto,
)
from tests.oci_images import Registry, busybox_image

USER, PASSWORD = "puller", "s3cret-of-the-registry"
GIT_TOKEN = "fleet-git-TOKEN-41c2"
REGISTRY = "registry.test"  # the name sandboxes (and builds, which pull in one) reach it by
S3_HOST = "s3.us-east-1.amazonaws.com"  # moto, by the name AWS rules sign for
BUCKET = "fleet-bucket"


@dataclass
class Outside:
    registry: Registry  # reached as REGISTRY
    image: str  # the busybox image on the registry (USER / PASSWORD pull it)
    ca_cert: Path  # what the nodes trust besides the usual roots
    hosts: dict[str, str]  # names the sandboxes reach them by (egress_hosts)
    seen: Recorder  # what the web server was sent
    answers: list[dict[str, Any]]  # the callback answers the last of them
    asked: Recorder  # what the callback was asked
    git_seen: Recorder  # what the git server (https://git.test/private.git) was sent
    aws_key: dict[str, str]  # moto's IAM user's AccessKeyId and SecretAccessKey
    s3: Any  # boto3's S3 client of moto with that key, from the host

    @classmethod
    @contextlib.contextmanager
    def started(cls, root: Path) -> Iterator[Outside]:
        prefix = free_loopback_block()
        ca = TestCA(root / "ca", [REGISTRY, f"{prefix}.1", "git.test", S3_HOST, f"{prefix}.5"])
        salt = "crypt.mksalt(crypt.METHOD_BLOWFISH)"
        crypt = f"import crypt; print(crypt.crypt({PASSWORD!r}, {salt}))"
        hashed = subprocess.run(
            ["/usr/bin/python3", "-W", "ignore", "-c", crypt],
            check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        (root / "htpasswd").write_text(f"{USER}:{hashed}\n")
        busybox_image(root / "layout")
        registry = Registry(
            root / "registry", f"{prefix}.1", ca, htpasswd=root / "htpasswd", name=REGISTRY
        )
        servers = Servers()
        moto = start_moto(f"{prefix}.5", ca, root / "moto.log")
        try:
            image = registry.push(
                f"oci:{root / 'layout'}:busybox", "team/busybox:1", creds=f"{USER}:{PASSWORD}"
            )
            seen = servers.start(EchoHandler, (f"{prefix}.2", 80))
            answers: list[dict[str, Any]] = [{"allow": False}]
            asked = servers.start(CallbackHandler, (f"{prefix}.3", 80), answers=answers)
            repo = root / "git"
            seed_repository(repo)
            git_seen = servers.start(
                GitHandler, (f"{prefix}.4", 443), ca.server_context(), root=repo, token=GIT_TOKEN
            )
            key = moto_key(f"{prefix}.5", ca, "agent")
            import boto3

            s3 = boto3.client(
                "s3", endpoint_url=f"https://{prefix}.5", region_name="us-east-1",
                aws_access_key_id=key["AccessKeyId"], aws_secret_access_key=key["SecretAccessKey"],
                verify=str(ca.cert),
            )  # fmt: skip
            s3.create_bucket(Bucket=BUCKET)
            hosts = {REGISTRY: f"{prefix}.1", "web.test": f"{prefix}.2",
                     "callback.test": f"{prefix}.3", "git.test": f"{prefix}.4",
                     S3_HOST: f"{prefix}.5"}  # fmt: skip
            yield cls(registry, image, ca.cert, hosts, seen, answers, asked, git_seen, key, s3)
        finally:
            servers.close()
            registry.close()
            moto.kill()
            moto.wait()


def seed_repository(root: Path) -> None:
    """`private.git` under `root`, its `main` holding README = "v1"."""
    who = {
        f"GIT_{role}_{what}": "t" for role in ("AUTHOR", "COMMITTER") for what in ("NAME", "EMAIL")
    }
    env = {"HOME": str(root), "PATH": "/usr/bin:/bin", **who}
    root.mkdir(parents=True)
    work = root / "work"

    def git(*argv: str, cwd: Path = root) -> None:
        subprocess.run(["git", *argv], cwd=cwd, env=env, check=True, capture_output=True)

    git("init", "-q", "--bare", "-b", "main", "private.git")
    git("init", "-q", "-b", "main", str(work))
    (work / "README").write_text("v1\n")
    git("add", "README", cwd=work)
    git("commit", "-q", "-m", "v1", cwd=work)
    git("push", "-q", str(root / "private.git"), "main", cwd=work)
