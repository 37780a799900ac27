"""An HTTP proxy on 127.0.0.1 between an S3 client and a real S3 server, to inject faults and count
bytes.

Requests are forwarded unchanged (the ``Host`` header included, so SigV4 signatures stay valid).
A :class:`Fault` matching a request replaces its forwarding with a dropped connection (after part
of the request body, before any answer), an S3 error status (``503 SlowDown``, ``500``), or a fake
success that never reaches the server (a server that ignores ``If-None-Match``). Every request is
logged with its method, path, query and the bytes of its body and of its answer's body.
"""

from __future__ import annotations

import http.client
import http.server
import re
import socket
import struct
import threading
from dataclasses import dataclass, field

ERRORS = {503: ("SlowDown", "Please reduce your request rate."),
          500: ("InternalError", "We encountered an internal error. Please try again.")}


@dataclass
class Fault:
    """What to do instead of forwarding requests that match.

    Attributes:
        action: ``"drop"`` (read half the body, then reset the connection), ``"drop_answer"``
            (forward the request, then reset the connection instead of answering), ``"drop_body"``
            (reset the connection after half of the answer's body), ``"long_body"`` and
            ``"short_body"`` (answer with 8 bytes more or fewer than the server's body, the
            length saying so: a server that breaks the range asked), ``"status"`` (answer
            ``status`` with an S3 error document), or ``"fake_ok"`` (answer 200 without
            forwarding).
        method: the HTTP method to match ("" for any).
        path: a regular expression searched in the path and query ("" for any).
        header: a request header that must be present ("" for none).
        skip: matching requests to forward unchanged first.
        times: matching requests to act on after those (then the fault is spent).
        status: the status for ``"status"``.
    """

    action: str
    method: str = ""
    path: str = ""
    header: str = ""
    skip: int = 0
    times: int = 1
    status: int = 503
    hits: int = 0

    def matches(self, method: str, target: str, headers: http.client.HTTPMessage) -> bool:
        return ((not self.method or method == self.method)
                and (not self.path or re.search(self.path, target) is not None)
                and (not self.header or self.header in headers))


@dataclass
class Exchange:
    """One request the proxy saw."""

    method: str
    target: str
    sent: int  # request body bytes
    received: int  # response body bytes
    fault: str = ""
    wire_sent: int = 0  # the request as sent: request line, headers and body
    wire_received: int = 0  # the answer as sent back: status line, headers and body
    payload: str = ""  # the request's x-amz-content-sha256: its body's digest, or UNSIGNED-PAYLOAD


@dataclass
class S3Proxy:
    """A running proxy; ``endpoint_url`` is what clients use instead of the server's."""

    upstream: str
    faults: list[Fault] = field(default_factory=list)
    log: list[Exchange] = field(default_factory=list)

    def __post_init__(self) -> None:
        host, port = self.upstream.removeprefix("http://").rstrip("/").split(":")
        self._up = (host, int(port))
        self._lock = threading.Lock()
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint_url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()
            self.log.clear()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _fault_for(self, method: str, target: str, headers: http.client.HTTPMessage) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.hits < f.skip + f.times and f.matches(method, target, headers):
                    f.hits += 1
                    if f.hits > f.skip:
                        return f
        return None

    def _record(self, exchange: Exchange) -> None:
        with self._lock:
            self.log.append(exchange)


class _Handler(http.server.BaseHTTPRequestHandler):
    owner: S3Proxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        pass

    def _any(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        fault = self.owner._fault_for(self.command, self.path, self.headers)
        if fault is not None and fault.action == "drop":
            self.rfile.read(length // 2)
            self.owner._record(Exchange(self.command, self.path, length // 2, 0, "drop"))
            self._reset()
            return
        body = self.rfile.read(length) if length else b""
        if fault is not None and fault.action not in ("drop_answer", "drop_body", "long_body", "short_body"):
            self.owner._record(Exchange(self.command, self.path, length, 0, fault.action))
            if fault.action == "fake_ok":
                self._answer(200, b"", {"ETag": '"00000000000000000000000000000000"'})
            else:
                code, message = ERRORS.get(fault.status, ("InternalError", "injected"))
                doc = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                       f"<Message>{message}</Message></Error>").encode()
                self._answer(fault.status, doc, {"Content-Type": "application/xml"})
            return
        up = http.client.HTTPConnection(*self.owner._up, timeout=120)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
            up.request(self.command, self.path, body=body, headers=headers)
            resp = up.getresponse()
            data = resp.read()
            if fault is not None and fault.action == "drop_body" and len(data) > 1:
                self.owner._record(Exchange(self.command, self.path, length, len(data) // 2, "drop_body"))
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self._reset()
                return
            if fault is not None and fault.action == "drop_answer":
                self.owner._record(Exchange(self.command, self.path, length, 0, "drop_answer"))
                self._reset()
                return
            if fault is not None and fault.action in ("long_body", "short_body"):
                data = data + bytes(8) if fault.action == "long_body" else data[:-8]
            dropped = ("transfer-encoding", "connection")
            if self.command != "HEAD":  # a HEAD's length is the object's, not of an empty body
                dropped += ("content-length",)
            out = {k: v for k, v in resp.getheaders() if k.lower() not in dropped}
            head = len(self.raw_requestline) + len(self.headers.as_bytes())
            answer_head = len(f"HTTP/1.1 {resp.status} {resp.reason}\r\n") + sum(
                len(f"{k}: {v}\r\n") for k, v in out.items()) + len(f"Content-Length: {len(data)}\r\n\r\n")
            self.owner._record(Exchange(self.command, self.path, length, len(data), "",
                                        head + length, answer_head + len(data),
                                        self.headers.get("x-amz-content-sha256", "")))
            self._answer(resp.status, data, out)
        finally:
            up.close()

    def _reset(self) -> None:
        """Closes the client's connection with a reset, as a dying server or network would."""
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()

    def _answer(self, status: int, data: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if not any(k.lower() == "content-length" for k in headers):
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any
