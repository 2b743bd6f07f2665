"""Several gateways behind one client: a request goes to the gateway that last answered,
and to the next when that one does not (`retryable` says when that is safe)."""

from __future__ import annotations

import httpx2

from cella.sdk._base import retryable


class AsyncFailover(httpx2.AsyncBaseTransport):
    def __init__(self, urls: list[str], inner: httpx2.AsyncBaseTransport | None = None) -> None:
        self.urls = [httpx2.URL(u) for u in urls]
        self.inner = inner or httpx2.AsyncHTTPTransport()
        self.current = 0  # the gateway that answered last
        self.failovers = 0  # how many times a request went on to another gateway

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        failure: httpx2.TransportError | None = None
        for step in range(len(self.urls)):
            at = (self.current + step) % len(self.urls)
            target = self.urls[at]
            request.url = request.url.copy_with(
                scheme=target.scheme, host=target.host, port=target.port
            )
            request.headers["Host"] = target.netloc.decode("ascii")
            try:
                response = await self.inner.handle_async_request(request)
            except httpx2.TransportError as exc:
                if not retryable(request, exc):
                    raise
                failure = exc
                self.failovers += 1
                continue
            self.current = at
            return response
        assert failure is not None
        raise failure

    async def aclose(self) -> None:
        await self.inner.aclose()
