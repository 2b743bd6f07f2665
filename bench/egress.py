"""Egress cost: one HTTP request from inside a sandbox, through each path of the proxy,
next to the same request to a server inside the guest (no proxy), in one run. Servers are
on loopback addresses of the host; each request is a new connection (the worst case:
one forward process and one proxy connection each).

    .venv/bin/python -m bench.egress [--requests 40] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench._stats import report
from cella import Client
from tests.daemon import Daemon, kill_vms_of
from tests.netservers import EchoHandler, Servers, TestCA, free_loopback_block

TIMER = r"""
import json, ssl, sys, time, urllib.request
n, cases = int(sys.argv[1]), json.loads(sys.argv[2])
ctx = ssl.create_default_context(cafile="/tmp/test-ca.pem")
ctx.load_verify_locations("/etc/ssl/certs/ca-certificates.crt")
out = {}
for name, (url, proxy) in cases.items():
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({"http": proxy, "https": proxy} if proxy else {}),
        urllib.request.HTTPSHandler(context=ctx),
    )
    times = []
    for i in range(n + 3):
        t = time.perf_counter()
        opener.open(url, timeout=30).read()
        if i >= 3:  # the first ones warm the translation cache
            times.append(time.perf_counter() - t)
    out[name] = times
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="cella-egress-"))
    prefix = free_loopback_block()
    ca = TestCA(base / "ca", ["web.test"])
    servers = Servers()
    servers.start(EchoHandler, (f"{prefix}.1", 80))
    servers.start(EchoHandler, (f"{prefix}.1", 443), ca.server_context())
    d = Daemon(
        base / "d",
        pool_size="0",
        egress_hosts=json.dumps({"web.test": f"{prefix}.1"}),
        egress_upstream_ca=str(ca.cert),
    ).start()
    proxy = "http://10.0.2.100:3128"
    try:
        with Client(d.url, d.admin_key) as c:
            c.put_secret("bench", "value", ["web.test"])
            sb = c.create(allow=["web.test"], secrets={"TOKEN": "bench"})
            sb.files.write("/tmp/test-ca.pem", ca.cert.read_bytes())
            sb.files.write("/tmp/timer.py", TIMER)
            sb.exec("cd /tmp && (python3 -m http.server 8080 >/dev/null 2>&1 &) ; sleep 1")
            cases = {
                "in-guest server, no proxy (baseline)": ["http://127.0.0.1:8080/timer.py", None],
                "HTTP, explicit proxy": ["http://web.test/", proxy],
                "HTTP, transparent": ["http://web.test/", None],
            }
            plain = c.create(allow=["web.test"])
            plain.files.write("/tmp/test-ca.pem", ca.cert.read_bytes())
            plain.files.write("/tmp/timer.py", TIMER)
            tls_cases = {
                "HTTPS passthrough, explicit proxy (CONNECT)": ["https://web.test/", proxy],
                "HTTPS passthrough, transparent (SNI)": ["https://web.test/", None],
            }
            secret_cases = {
                "HTTPS intercepted (secret bound), explicit proxy": ["https://web.test/", proxy],
                "HTTPS intercepted (secret bound), transparent": ["https://web.test/", None],
            }
            results: dict[str, list[float]] = {}
            for box, group in ((sb, cases), (plain, tls_cases), (sb, secret_cases)):
                r = box.exec(
                    ["python3", "/tmp/timer.py", str(args.requests), json.dumps(group)],
                    env={"no_proxy": "", "NO_PROXY": ""},
                    timeout=600,
                )
                assert r.exit_code == 0, r.stderr
                results |= json.loads(r.stdout)
            baseline = sorted(results["in-guest server, no proxy (baseline)"])
            base_p50 = baseline[len(baseline) // 2]
            rows = {}
            for name, times in results.items():
                ms = sorted(t * 1000 for t in times)
                rows[name] = {
                    "n": len(ms),
                    "min": round(ms[0], 2),
                    "p50": round(ms[len(ms) // 2], 2),
                    "p99": round(ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))], 2),
                    "max": round(ms[-1], 2),
                    "ratio": round(ms[len(ms) // 2] / (base_p50 * 1000), 1),  # to baseline
                }
            sb.delete()
            plain.delete()
    finally:
        d.stop()
        kill_vms_of(d.data_dir)
        servers.close()
    report("one request per new connection, from inside a sandbox (TCG)", rows, args.json)


if __name__ == "__main__":
    main()
