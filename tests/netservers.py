"""Real servers on loopback addresses for egress tests: an HTTP/HTTPS echo server and a git
smart-HTTP server (git http-backend) behind HTTPS, with a throwaway test CA (openssl)."""

from __future__ import annotations

import base64
import gzip
import http.server
import ipaddress
import json
import os
import random
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any


def free_loopback_block() -> str:
    """A 127.a.b.0 prefix whose .1-.9 addresses have ports 80 and 443 free."""
    for _ in range(100):
        prefix = f"127.{random.randrange(200, 250)}.{random.randrange(256)}"
        try:
            for host in range(1, 10):
                for port in (80, 443):
                    with socket.socket() as s:
                        s.bind((f"{prefix}.{host}", port))
        except OSError:
            continue
        return prefix
    raise RuntimeError("no free loopback block")


def _san(name: str) -> str:
    try:
        ipaddress.ip_address(name)
        return f"IP:{name}"
    except ValueError:
        return f"DNS:{name}"


class TestCA:
    """A CA and one server certificate for the given names."""

    __test__ = False

    def __init__(self, directory: Path, names: list[str]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.cert = directory / "ca.pem"
        self.server_cert = directory / "server.pem"
        self.server_key = directory / "server.key"
        key = directory / "ca.key"
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        subprocess.run(
            ["openssl", "req", "-x509", *ec, "-keyout", key, "-out", self.cert, "-days", "2",
             "-subj", "/CN=cella test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
            check=True, capture_output=True,
        )  # fmt: skip
        csr = directory / "server.csr"
        subprocess.run(
            ["openssl", "req", *ec, "-keyout", self.server_key, "-out", csr,
             "-subj", f"/CN={names[0]}"],
            check=True, capture_output=True,
        )  # fmt: skip
        ext = directory / "ext.cnf"
        ext.write_text(
            "subjectAltName=" + ",".join(_san(n) for n in names) + "\n"
            "basicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
        )
        subprocess.run(
            ["openssl", "x509", "-req", "-in", csr, "-CA", self.cert, "-CAkey", key,
             "-CAcreateserial", "-out", self.server_cert, "-days", "2", "-extfile", ext],
            check=True, capture_output=True,
        )  # fmt: skip

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.server_cert, self.server_key)
        return ctx


class Recorder:
    """What a server saw, for assertions."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def add(self, entry: dict[str, Any]) -> None:
        with self.lock:
            self.requests.append(entry)


class EchoHandler(http.server.BaseHTTPRequestHandler):
    """Answers with what it received: method, path, headers, body (as JSON)."""

    recorder: Recorder
    protocol_version = "HTTP/1.1"

    def _echo(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        seen = {
            "method": self.command,
            "path": self.path,
            "headers": {k.lower(): v for k, v in self.headers.items()},  # h2 sends lower case
            "body": body.decode("utf-8", "replace"),
            "server": self.server.server_address[0],
        }
        self.recorder.add(seen)
        out = json.dumps(seen).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = do_PUT = _echo

    def log_message(self, *args: Any) -> None:
        pass


class GitHandler(http.server.BaseHTTPRequestHandler):
    """git smart HTTP through `git http-backend`; every request needs the token (basic),
    unless the token is empty (a public server)."""

    root: Path
    token: str
    recorder: Recorder

    def _cgi(self) -> None:
        auth = self.headers.get("Authorization", "")
        self.recorder.add({"method": self.command, "path": self.path, "authorization": auth})
        expected = "Basic " + base64.b64encode(f"x-access-token:{self.token}".encode()).decode()
        if self.token and auth != expected:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="git"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = b""
            while size := int(self.rfile.readline().strip() or b"0", 16):
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path, _, query = self.path.partition("?")
        env = {
            "GIT_PROJECT_ROOT": str(self.root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "PATH_INFO": path,
            "QUERY_STRING": query,
            "REQUEST_METHOD": self.command,
            "CONTENT_TYPE": self.headers.get("Content-Type", ""),
            "CONTENT_LENGTH": str(len(body)),
            "HTTP_CONTENT_ENCODING": self.headers.get("Content-Encoding", ""),
            "GIT_PROTOCOL": self.headers.get("Git-Protocol", ""),
            "REMOTE_USER": "agent",  # enables receive-pack (push)
            "REMOTE_ADDR": "127.0.0.1",
            "PATH": "/usr/bin:/bin",
        }
        out = subprocess.run(
            ["git", "http-backend"], input=body, env=env, capture_output=True, check=False
        ).stdout
        head, _, payload = out.partition(b"\r\n\r\n")
        if not _:
            head, _, payload = out.partition(b"\n\n")
        status = 200
        headers = []
        for line in head.decode().splitlines():
            key, _, value = line.partition(":")
            if key.lower() == "status":
                status = int(value.split()[0])
            elif key:
                headers.append((key, value.strip()))
        self.send_response(status)
        for key, value in headers:
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _cgi

    def log_message(self, *args: Any) -> None:
        pass


class Servers:
    """Servers started on demand; all stopped by `close()`."""

    def __init__(self) -> None:
        self._servers: list[http.server.ThreadingHTTPServer] = []

    def start(
        self,
        handler: type[http.server.BaseHTTPRequestHandler],
        addr: tuple[str, int],
        tls: ssl.SSLContext | None = None,
        **attrs: Any,
    ) -> Recorder:
        recorder = Recorder()
        cls = type(handler.__name__, (handler,), {"recorder": recorder, **attrs})
        srv = http.server.ThreadingHTTPServer(addr, cls)
        srv.daemon_threads = True
        if tls is not None:
            srv.socket = tls.wrap_socket(srv.socket, server_side=True)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        self._servers.append(srv)
        return recorder

    def close(self) -> None:
        for srv in self._servers:
            srv.shutdown()
            srv.server_close()


class HostileHandler(http.server.BaseHTTPRequestHandler):
    """A server that hands back what it was sent, in every way a proxy might miss:

    /reflect         the request as JSON (headers, path, body)
    /big             the same after 17 MiB of filler (past any buffering limit)
    /chunked         the same, chunked in small pieces
    /reason          the Authorization header as the reason phrase
    /malformed       a broken status line quoting the request line
    /gzip            the request as gzip-compressed JSON
    /store (POST)    keeps the body; /notes serves everything kept (shared by every server
                     started with the same `notes` list, as a CDN in front of it would)
    """

    recorder: Recorder
    notes: list[str]
    protocol_version = "HTTP/1.1"

    def _seen(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        seen = {
            "path": self.path,
            "headers": {k.lower(): v for k, v in self.headers.items()},
            "body": body.decode("utf-8", "replace"),
        }
        self.recorder.add(seen)
        return json.dumps(seen).encode()

    def _send(self, status: int, body: bytes, reason: str | None = None, **headers: str) -> None:
        self.send_response(status, reason)
        for key, value in headers.items():
            self.send_header(key.replace("_", "-"), value)
        if "Transfer_Encoding" not in headers:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _handle(self) -> None:
        seen = self._seen()
        path = self.path.split("?")[0]
        if path == "/big":
            filler = b"." * (17 << 20)
            self._send(200, filler + seen, Content_Type="text/plain")
        elif path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(seen), 7):
                piece = seen[i : i + 7]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        elif path == "/reason":
            self._send(200, b"ok\n", reason=self.headers.get("Authorization", "none"))
        elif path == "/malformed":
            self.wfile.write(f"HTTP/1.1 ??? {self.requestline}\r\n\r\n".encode())
            self.close_connection = True
        elif path == "/gzip":
            self._send(200, gzip.compress(seen), Content_Encoding="gzip")
        elif path == "/store":
            self.notes.append(json.loads(seen)["body"])
            self._send(200, b"stored\n")
        elif path == "/notes":
            self._send(200, "\n".join(self.notes).encode())
        else:
            self._send(200, seen, Content_Type="application/json")

    do_GET = do_POST = _handle

    def log_message(self, *args: Any) -> None:
        pass


class DnsRecorder:
    """A DNS server on a loopback address that records every name it is asked for and
    answers NXDOMAIN: to see what a process whose resolver points here looks up."""

    def __init__(self, addr: str) -> None:
        self.names: list[str] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((addr, 53))
        self.addr = addr
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                query, peer = self.sock.recvfrom(512)
            except OSError:
                return
            labels, i = [], 12
            while i < len(query) and query[i]:
                labels.append(query[i + 1 : i + 1 + query[i]].decode(errors="replace"))
                i += query[i] + 1
            self.names.append(".".join(labels).lower())
            flags = (query[2] | 0x80).to_bytes(1, "big") + b"\x83"  # response, NXDOMAIN
            self.sock.sendto(query[:2] + flags + query[4:6] + b"\0\0\0\0\0\0" + query[12:], peer)

    def close(self) -> None:
        self.sock.close()


class GcsHandler(http.server.BaseHTTPRequestHandler):
    """A stand-in for Google Cloud Storage's JSON API, as much of it as a bucket mount uses:
    list (prefix, delimiter), object metadata, media (with ranges), multipart uploads (up to
    16 MiB: bigger ones are resumable, which it does not take), patch, rewrite and delete.
    Every request must carry a bearer token from `issued` (the token endpoint's), else 401;
    what it saw is recorded."""

    recorder: Recorder
    issued: list[str]
    objects: dict[tuple[str, str], tuple[bytes, dict[str, Any]]]  # (bucket, name) ->
    scheme = "https"
    protocol_version = "HTTP/1.1"

    def _route(self) -> None:
        from urllib.parse import parse_qs, unquote, urlsplit

        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        auth = self.headers.get("Authorization", "")
        ok = auth in {f"Bearer {t}" for t in self.issued}
        body = self._body()
        self.recorder.add({"method": self.command, "path": self.path, "authorization": auth,
                           "ok": ok})  # fmt: skip
        if not ok:
            return self._json(401, {"error": {"code": 401, "message": "no valid bearer"}})
        path = parts.path
        for head in ("/upload", "/download"):
            path = path.removeprefix(head)
        segs = path.split("/")  # "", storage, v1, b, BUCKET, o, NAME, [rewriteTo, b, B, o, N]
        if segs[1:4] != ["storage", "v1", "b"] or len(segs) < 6 or segs[5] != "o":
            return self._json(404, {"error": {"code": 404, "message": f"no route {path}"}})
        bucket = unquote(segs[4])
        name = unquote(segs[6]) if len(segs) > 6 else None
        if parts.path.startswith("/upload"):
            return self._upload(bucket, query, body)
        if name is None and self.command == "GET":
            return self._list(bucket, query)
        if name is None:
            return self._json(405, {"error": {"code": 405, "message": "not here"}})
        if len(segs) > 10 and segs[7] in ("rewriteTo", "copyTo"):
            found = self.objects.get((bucket, name))
            if found is None:
                return self._json(404, {"error": {"code": 404, "message": "no such object"}})
            target = (unquote(segs[9]), unquote(segs[11]))
            meta = {**found[1], **(json.loads(body) if body else {})}
            meta.update(bucket=target[0], name=target[1])
            self.objects[target] = (found[0], meta)
            obj = self._resource(*target)
            if segs[7] == "copyTo":
                return self._json(200, obj)
            return self._json(200, {"kind": "storage#rewriteResponse", "done": True,
                                    "totalBytesRewritten": obj["size"],
                                    "objectSize": obj["size"], "resource": obj})  # fmt: skip
        if (bucket, name) not in self.objects:
            return self._json(404, {"error": {"code": 404, "message": "no such object"}})
        if self.command == "DELETE":
            del self.objects[(bucket, name)]
            return self._send(204, b"", "application/json")
        if self.command == "PATCH":
            meta = self.objects[(bucket, name)][1]
            patch = json.loads(body or b"{}")
            meta["metadata"] = {**meta.get("metadata", {}), **patch.get("metadata", {})}
            return self._json(200, self._resource(bucket, name))
        if query.get("alt") == "media" or parts.path.startswith("/download"):
            return self._media(self.objects[(bucket, name)][0])
        return self._json(200, self._resource(bucket, name))

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _route

    def _body(self) -> bytes:
        if "chunked" not in self.headers.get("Transfer-Encoding", ""):
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""
        out = b""
        while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
            out += self.rfile.read(size)
            self.rfile.readline()
        self.rfile.readline()  # the empty trailer
        return out

    def _list(self, bucket: str, query: dict[str, str]) -> None:
        prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
        items, prefixes = [], set()
        for b, name in sorted(self.objects):
            if b != bucket or not name.startswith(prefix):
                continue
            rest = name[len(prefix) :]
            if delimiter and delimiter in rest:
                prefixes.add(prefix + rest.split(delimiter)[0] + delimiter)
            else:
                items.append(self._resource(b, name))
        self._json(200, {"kind": "storage#objects", "items": items, "prefixes": sorted(prefixes)})

    def _upload(self, bucket: str, query: dict[str, str], body: bytes) -> None:
        kind = query.get("uploadType")
        if kind == "multipart":
            boundary = self.headers.get_content_type() and self.headers.get_param("boundary")
            chunks = body.split(b"--" + str(boundary).encode())
            meta_part, media_part = chunks[1], chunks[2]
            meta = json.loads(meta_part.split(b"\r\n\r\n", 1)[1])
            data = media_part.split(b"\r\n\r\n", 1)[1].removesuffix(b"\r\n")
            return self._store(bucket, query.get("name") or meta["name"], data, meta)
        return self._json(400, {"error": {"code": 400, "message": f"uploadType {kind}"}})

    def _store(self, bucket: str, name: str, data: bytes, meta: dict[str, Any]) -> None:
        import time

        meta = {**meta, "bucket": bucket, "name": name, "updated": time.strftime(
            "%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())}  # fmt: skip
        self.objects[(bucket, name)] = (data, meta)
        self._json(200, self._resource(bucket, name))

    def _resource(self, bucket: str, name: str) -> dict[str, Any]:
        import hashlib
        from urllib.parse import quote

        data, meta = self.objects[(bucket, name)]
        link = f"{self.scheme}://{self.headers.get('Host')}/download/storage/v1/b/{bucket}/o/"
        return {
            "updated": "2026-01-01T00:00:00.000Z",
            **meta,
            "kind": "storage#object",
            "bucket": bucket,
            "name": name,
            "size": str(len(data)),
            "generation": "1",
            "md5Hash": base64.b64encode(hashlib.md5(data).digest()).decode(),
            "contentType": meta.get("contentType") or "application/octet-stream",
            "mediaLink": f"{link}{quote(name, safe='')}?generation=1&alt=media",
        }

    def _media(self, data: bytes) -> None:
        wanted = self.headers.get("Range", "")
        if wanted.startswith("bytes="):
            first, _, last = wanted[6:].partition("-")
            start, end = int(first or 0), min(int(last) if last else len(data) - 1, len(data) - 1)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            chunk = data[start : end + 1]
        else:
            self.send_response(200)
            chunk = data
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(chunk)))
        self.end_headers()
        self.wfile.write(chunk)

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def _send(self, status: int, out: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: Any) -> None:
        pass


def start_moto(addr: str, ca: TestCA, log: Path) -> subprocess.Popen[bytes]:
    """moto's server on `addr:443` with `ca`'s certificate, checking signatures once its
    first three calls (the IAM setup of `moto_key`) are done; returned once it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", addr, "-p", "443",
         "-c", str(ca.server_cert), "-k", str(ca.server_key)],
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"},
        stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto exited: {log.read_text()[-2000:]}")
        try:
            socket.create_connection((addr, 443), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("moto did not start")


def moto_key(addr: str, ca: TestCA, user: str) -> dict[str, str]:
    """An IAM user of the moto at `addr` allowed everything, and its access key (moto's
    first three calls, made before it checks signatures)."""
    import boto3

    iam = boto3.client(
        "iam", endpoint_url=f"https://{addr}", region_name="us-east-1",
        aws_access_key_id="setup", aws_secret_access_key="setup", verify=str(ca.cert),
    )  # fmt: skip
    iam.create_user(UserName=user)
    allow_all = {"Effect": "Allow", "Action": "*", "Resource": "*"}
    iam.put_user_policy(
        UserName=user,
        PolicyName="all",
        PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [allow_all]}),
    )
    key: dict[str, str] = iam.create_access_key(UserName=user)["AccessKey"]
    return key


class UpstreamProxy:
    """A tenant's own proxy on loopback, SOCKS5 (`socks5`, RFC 1928/1929) or HTTP CONNECT
    (`http`), that records each tunnel it was asked for (`target`, `user`) and carries it."""

    def __init__(
        self, addr: tuple[str, int], scheme: str, credentials: tuple[str, str] | None = None
    ) -> None:
        self.scheme = scheme
        self.credentials = credentials
        self.seen = Recorder()
        self._sock = socket.create_server(addr)
        self.address = self._sock.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                found = self._socks5(conn) if self.scheme == "socks5" else self._connect(conn)
            except (OSError, ValueError):
                return
            if found is None:
                return
            target, user = found
            host, _, port = target.rpartition(":")
            self.seen.add({"target": target, "user": user})
            try:
                out = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
            except OSError:
                conn.sendall(b"\x05\x05\x00\x01\0\0\0\0\0\0" if self.scheme == "socks5" else
                             b"HTTP/1.1 502 Bad Gateway\r\n\r\n")  # fmt: skip
                return
            conn.sendall(b"\x05\x00\x00\x01\0\0\0\0\0\0" if self.scheme == "socks5" else
                         b"HTTP/1.1 200 Connection established\r\n\r\n")  # fmt: skip
            with out:
                _splice(conn, out)

    def _socks5(self, conn: socket.socket) -> tuple[str, str | None] | None:
        _, count = _read(conn, 2)
        methods = _read(conn, count)
        user = None
        if self.credentials is not None:
            if 2 not in methods:
                conn.sendall(b"\x05\xff")
                return None
            conn.sendall(b"\x05\x02")
            _, ulen = _read(conn, 2)
            user = _read(conn, ulen).decode()
            (plen,) = _read(conn, 1)
            password = _read(conn, plen).decode()
            if (user, password) != self.credentials:
                conn.sendall(b"\x01\x01")
                return None
            conn.sendall(b"\x01\x00")
        else:
            conn.sendall(b"\x05\x00")
        _, _, _, kind = _read(conn, 4)
        if kind == 1:
            host = str(ipaddress.ip_address(_read(conn, 4)))
        elif kind == 4:
            host = f"[{ipaddress.ip_address(_read(conn, 16))}]"
        else:
            host = _read(conn, _read(conn, 1)[0]).decode()
        port = int.from_bytes(_read(conn, 2), "big")
        return f"{host}:{port}", user

    def _connect(self, conn: socket.socket) -> tuple[str, str | None] | None:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(4096)
            if not chunk:
                return None
            head += chunk
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        auth = next((v for k, _, v in (x.partition(": ") for x in lines[1:])
                     if k.lower() == "proxy-authorization"), "")  # fmt: skip
        user = None
        if auth.startswith("Basic "):
            user, _, password = base64.b64decode(auth[6:]).decode().partition(":")
            if self.credentials is not None and (user, password) != self.credentials:
                conn.sendall(b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n")
                return None
        elif self.credentials is not None:
            conn.sendall(b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n")
            return None
        if method != "CONNECT":
            conn.sendall(b"HTTP/1.1 405 Method Not Allowed\r\n\r\n")
            return None
        return target, user

    def close(self) -> None:
        self._sock.close()


def _read(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ValueError("the client went away")
        data += chunk
    return data


def _splice(a: socket.socket, b: socket.socket) -> None:
    def one_way(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    back = threading.Thread(target=one_way, args=(b, a), daemon=True)
    back.start()
    one_way(a, b)
    back.join(60)
