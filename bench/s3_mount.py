"""Reading a 100 MiB object through an S3 bucket mount in the guest (rclone, through the
egress proxy, which signs every request) next to `boto3` on the host against the same
moto S3 server (SigV4 enforced, TLS, on a loopback address under AWS's name), in one run.
A cold read is each object's first (through rclone and the proxy); a warm read is the same
object again (from the mount's VFS cache on the guest's disk).

    .venv/bin/python -m bench.s3_mount [--mib 100] [--reads 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import boto3
from botocore.client import Config

from bench._stats import report, summary_ms
from cella import Client
from cella.models import BucketMount
from tests.daemon import Daemon, kill_vms_of
from tests.netservers import TestCA, free_loopback_block, moto_key, start_moto

S3_HOST = "s3.us-east-1.amazonaws.com"
BUCKET = "bench"
TIMER = r"""
import json, sys, time
out = []
for path in sys.argv[1:]:
    t = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass
    out.append(time.perf_counter() - t)
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=100)
    parser.add_argument("--reads", type=int, default=2, help="objects read (each cold, warm)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="cella-s3-mount-"))
    prefix = free_loopback_block()
    s3 = f"{prefix}.4"
    ca = TestCA(base / "ca", [S3_HOST, s3])
    moto = start_moto(s3, ca, base / "moto.log")
    d: Daemon | None = None
    try:
        key = moto_key(s3, ca, "bench")
        client = boto3.client(
            "s3", endpoint_url=f"https://{s3}", region_name="us-east-1", verify=str(ca.cert),
            aws_access_key_id=key["AccessKeyId"], aws_secret_access_key=key["SecretAccessKey"],
            config=Config(s3={"addressing_style": "path"}),
        )  # fmt: skip
        client.create_bucket(Bucket=BUCKET)
        names = [f"big-{i}.bin" for i in range(args.reads)]
        for name in names:
            client.put_object(Bucket=BUCKET, Key=name, Body=os.urandom(args.mib << 20))
        host: list[float] = []
        for name in names:
            t = time.perf_counter()
            body = client.get_object(Bucket=BUCKET, Key=name)["Body"]
            while body.read(1 << 20):
                pass
            host.append(time.perf_counter() - t)
        d = Daemon(
            base / "d",
            pool_size="0",
            egress_hosts=json.dumps({S3_HOST: s3}),
            egress_upstream_ca=str(ca.cert),
        ).start()
        with Client(d.url, d.admin_key) as c:
            c.put_secret("bench-key-id", key["AccessKeyId"], [S3_HOST])
            c.put_secret("bench-secret", key["SecretAccessKey"], [S3_HOST])
            mount = BucketMount.model_validate({
                "id": "bench", "type": "s3", "path": "/mnt/bench", "bucket": BUCKET,
                "endpoint_url": f"https://{S3_HOST}", "path_style": True, "read_only": True,
                "auth": {"access_key_id": "bench-key-id", "secret_access_key": "bench-secret"},
            })  # fmt: skip
            sb = c.create(bucket_mounts=[mount], memory_mib=1024, disk_mib=8192)
            sb.files.write("/tmp/timer.py", TIMER)
            paths = [f"/mnt/bench/{n}" for n in names]
            timed = {}
            for label in ("cold", "warm"):
                r = sb.exec(["python3", "/tmp/timer.py", *paths], timeout=3600)
                assert r.exit_code == 0, r.stderr.decode()
                timed[label] = json.loads(r.stdout)
            sb.delete()
    finally:
        if d is not None:
            d.stop()
            kill_vms_of(d.data_dir)
        moto.kill()
        moto.wait()
    rows = {}
    for name, times in (
        ("boto3 on the host, same moto", host),
        ("S3 mount in the guest, cold (rclone + proxy signing)", timed["cold"]),
        ("S3 mount in the guest, warm (VFS cache)", timed["warm"]),
    ):
        mib_s = [args.mib / t for t in times]
        rows[name] = {**summary_ms(times), "MiB/s (p50)": round(sorted(mib_s)[len(mib_s) // 2], 1)}
    report(f"reading a {args.mib} MiB object (TCG guest)", rows, args.json)


if __name__ == "__main__":
    main()
