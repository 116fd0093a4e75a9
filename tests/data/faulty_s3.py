"""A front for the moto S3 server that fails on purpose: an HTTP proxy on 127.0.0.1 that forwards every request to
moto and, by the count of object GETs (not at random, so every run fails the same way), answers one of them with:

    "503"    503 SlowDown, as S3 throttles (botocore's standard retries must absorb it)
    "reset"  the headers and half the body, then a TCP reset (a connection dropped mid-stream)
    "stall"  the headers and half the body, then silence longer than s3.read_timeout (a body that trickles)

    proxy.plan = [None, "reset"]    # the 1st object GET passes, the 2nd is cut; later ones pass
    proxy.gets                      # [(key, Range header, fault)] of each object GET, in order

Only GETs of an object count (listing a bucket is a GET of the bucket, HEADs are metadata): those carry the data.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>faulty-s3</RequestId></Error>"
)
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}


class FaultyS3:
    def __init__(self, upstream: str, stall_s: float = 2.0):
        self.upstream = urlsplit(upstream).netloc
        self.stall_s = stall_s  # must exceed the client's s3.read_timeout
        self.plan: list[str | None] = []
        self.gets: list[tuple[str, str | None, str | None]] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._resets: set = set()  # connections to close with a reset
        self._server = _Server(("127.0.0.1", 0), _handler(self))
        self._server.proxy = self
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def fault_for(self, method: str, path: str, range_: str | None) -> str | None:
        """The fault of this request: the next of the plan for an object GET, else none."""
        key = urlsplit(path).path.lstrip("/")
        if method != "GET" or "/" not in key or "list-type" in urlsplit(path).query:
            return None
        with self._lock:
            fault = self.plan.pop(0) if self.plan else None
            self.gets.append((key, range_, fault))
        return fault

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    proxy: FaultyS3

    def shutdown_request(self, request):
        # socketserver shuts the socket down (a FIN, a clean end) before closing it; a reset must skip that.
        if request in self.proxy._resets:
            self.proxy._resets.discard(request)
            return self.close_request(request)
        super().shutdown_request(request)


def _handler(proxy: FaultyS3):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as clients pool connections to S3

        def log_message(self, *args):  # quiet: pytest shows the test's own output
            pass

        def do_HEAD(self):
            self._forward()

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD

        def _forward(self):
            fault = proxy.fault_for(self.command, self.path, self.headers.get("Range"))
            if fault == "503":
                return self._answer(503, {"Content-Type": "application/xml"}, SLOW_DOWN)
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            upstream = http.client.HTTPConnection(proxy.upstream, timeout=30)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
                upstream.request(self.command, self.path, body=body, headers=headers)
                resp = upstream.getresponse()
                data = resp.read()
                kept = {k: v for k, v in resp.getheaders() if k.lower() not in _HOP}
                if self.command == "HEAD":
                    kept["Content-Length"] = resp.getheader("Content-Length", "0")
                    return self._answer(resp.status, kept, b"", head=True)
            finally:
                upstream.close()
            if fault in ("reset", "stall"):
                return self._cut(resp.status, kept, data, fault)
            self._answer(resp.status, kept, data)

        def _answer(self, status, headers, data, head=False):
            self.send_response_only(status)
            for k, v in headers.items():
                self.send_header(k, v)
            if not head:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()

        def _cut(self, status, headers, data, fault):
            """The headers (with the full length) and half the body, then a reset or a stall; the connection is
            not reused."""
            self.close_connection = True
            self.send_response_only(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                if fault == "stall":
                    proxy._closing.wait(proxy.stall_s)
                # SO_LINGER 0: close() sends RST, not FIN: the peer sees "connection reset" mid-body.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                proxy._resets.add(self.connection)
            except OSError:
                pass  # the client gave up first

    return Handler
