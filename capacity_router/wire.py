"""HTTP/1.1 message framing for the relay (RFC 9112), as pure functions on bytes.

The relay parses a request head and a worker's response head once each, in plain
Python, and then only *scans* a body for its end: a ``Content-Length`` countdown or
the chunked framing (:class:`ChunkedScanner`), so the worker's bytes go to the client
as they came, never decoded and re-encoded. Anything that could frame one message two
ways is refused: ``Transfer-Encoding`` on a request (411), two ``Content-Length``
values, obsolete line folding, a control character in a header, a head over
:data:`MAX_HEAD_BYTES`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

MAX_HEAD_BYTES = 64 << 10
MAX_HEADERS = 128

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_DIGITS = re.compile(rb"[0-9]{1,18}\Z")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}\Z")
_REASON = re.compile(rb"[\t\x20-\x7e\x80-\xff]*\Z")  # RFC 9112 4: HTAB, SP, VCHAR, obs-text
_CHUNK_EXT = re.compile(rb"[\t\x20-\x7e\x80-\xff]*\Z")  # no CR, LF, NUL, ESC in a chunk line


class BadMessage(ValueError):
    """A head or a chunked body that cannot be framed one way only. ``status`` is the
    answer a client gets for it."""

    def __init__(self, reason: str, status: int = 400) -> None:
        super().__init__(reason)
        self.status = status


Header = tuple[bytes, bytes]  # (name in lower case, value as sent)


def _headers(lines: list[bytes]) -> list[Header]:
    if len(lines) > MAX_HEADERS:
        raise BadMessage(f"more than {MAX_HEADERS} header fields", 431)
    found: list[Header] = []
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.match(name):  # also obsolete folding: a leading space
            raise BadMessage("a header line that is not a field")
        value = value.strip(b" \t")
        if _BAD_VALUE.search(value):
            raise BadMessage("a control character in a header value")
        found.append((name.lower(), value))
    return found


def http_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets (RFC 3986 3.2.2)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def connection_tokens(headers: Iterable[Header]) -> frozenset[bytes]:
    """The names listed in ``Connection`` (lower case)."""
    return frozenset(
        token.strip().lower()
        for name, value in headers
        if name == b"connection"
        for token in value.split(b",")
        if token.strip()
    )


def content_length(headers: list[Header]) -> int | None:
    values = {value for name, value in headers if name == b"content-length"}
    if not values:
        return None
    if len(values) > 1:
        raise BadMessage("two different Content-Length values")
    (value,) = values
    if not _DIGITS.match(value):
        raise BadMessage("a Content-Length that is not a number")
    return int(value)


@dataclass(frozen=True, slots=True)
class RequestHead:
    method: str
    target: str  # path and query, as sent
    version: bytes  # b"1.1" or b"1.0"
    headers: list[Header]
    length: int  # of the body: 0 when none was declared

    def get(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    @property
    def keep_alive(self) -> bool:
        return self.version == b"1.1" and b"close" not in connection_tokens(self.headers)


def parse_request_head(head: bytes) -> RequestHead:
    """A request head without its final empty line."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not _TOKEN.match(parts[0]) or not parts[1]:
        raise BadMessage("a request line that is not METHOD TARGET HTTP/1.1")
    method, target, version = parts
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise BadMessage("an HTTP version other than 1.1 or 1.0", 505)
    if not target.startswith(b"/") or _BAD_VALUE.search(target) or b"#" in target:
        raise BadMessage("a request target that is not an absolute path")
    headers = _headers(lines[1:])
    if any(name == b"transfer-encoding" for name, _ in headers):
        raise BadMessage("a request body with Transfer-Encoding: send Content-Length", 411)
    length = content_length(headers) or 0
    return RequestHead(method.decode(), target.decode("latin-1"), version[5:], headers, length)


@dataclass(frozen=True, slots=True)
class ResponseHead:
    status: int
    reason: bytes
    headers: list[Header]
    chunked: bool
    length: int | None  # None with chunked, or when the body ends at the close
    keep_alive: bool


def parse_response_head(head: bytes) -> ResponseHead:
    """A worker's response head without its final empty line."""
    lines = head.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code, _, reason = rest.partition(b" ")
    if (
        version not in (b"HTTP/1.1", b"HTTP/1.0")
        or not _DIGITS.match(code)
        or len(code) != 3
        or not 100 <= int(code) <= 599
    ):
        raise BadMessage("a status line that is not HTTP/1.1 NNN", 502)
    if not _REASON.match(reason):  # a bare LF there ends the line for a lenient client
        raise BadMessage("a control character in the reason phrase", 502)
    try:
        headers = _headers(lines[1:])
    except BadMessage as exc:
        raise BadMessage(str(exc), 502) from None
    status = int(code)
    coding = [v for n, v in headers if n == b"transfer-encoding"]
    chunked = bool(coding) and coding[-1].rsplit(b",", 1)[-1].strip().lower() == b"chunked"
    if coding and not chunked:
        raise BadMessage("a Transfer-Encoding that does not end in chunked", 502)
    try:
        length = None if chunked else content_length(headers)
    except BadMessage as exc:
        raise BadMessage(str(exc), 502) from None
    if status in (204, 304) or 100 <= status < 200:
        length, chunked = 0, False
    tokens = connection_tokens(headers)
    keep_alive = (
        version == b"HTTP/1.1" and b"close" not in tokens and (chunked or length is not None)
    )
    return ResponseHead(status, reason, headers, chunked, length, keep_alive)


class ChunkedScanner:
    """Finds where a chunked body ends without changing a byte of it.

    :meth:`feed` takes the next bytes and returns how many of them belong to the body
    (all of them until the end is seen); ``done`` is then true. :meth:`data` gives the
    payload of the bytes fed last, for an HTTP/1.0 client that cannot read chunks.
    """

    __slots__ = ("_data", "_left", "_line", "_state", "_trailers", "done")

    _SIZE, _DATA, _DATA_END, _TRAILER = range(4)

    def __init__(self) -> None:
        self._state = self._SIZE
        self._left = 0
        self._line = b""
        self._trailers = 0
        self.done = False
        self._data: list[bytes] = []

    def data(self) -> bytes:
        out = b"".join(self._data)
        self._data.clear()
        return out

    def feed(self, buf: bytes, *, keep_data: bool = False) -> int:
        i, n = 0, len(buf)
        while i < n and not self.done:
            state = self._state
            if state == self._DATA:
                take = min(self._left, n - i)
                if keep_data:
                    self._data.append(buf[i : i + take])
                i += take
                self._left -= take
                if self._left == 0:
                    self._state = self._DATA_END
                continue
            end = buf.find(b"\n", i)
            if end < 0:
                self._line += buf[i:]
                if len(self._line) > 4096:
                    raise BadMessage("a chunk line over 4 KiB", 502)
                return n
            line = self._line + buf[i:end]
            self._line = b""
            i = end + 1
            if not line.endswith(b"\r"):
                raise BadMessage("a chunk line that does not end in CRLF", 502)
            line = line[:-1]
            if state == self._SIZE:
                size, semicolon, extension = line.partition(b";")
                if not _HEX.match(size) or (semicolon and not _CHUNK_EXT.match(extension)):
                    raise BadMessage("a chunk size line that is not hexadecimal", 502)
                self._left = int(size, 16)
                self._state = self._DATA if self._left else self._TRAILER
            elif state == self._DATA_END:
                if line:
                    raise BadMessage("a chunk longer than its size", 502)
                self._state = self._SIZE
            elif not line:  # the empty line after the trailers
                self.done = True
            else:
                self._trailers += 1
                if self._trailers > MAX_HEADERS:
                    raise BadMessage(f"more than {MAX_HEADERS} trailer fields", 502)
                try:
                    _headers([line])
                except BadMessage as exc:
                    raise BadMessage(f"a trailer: {exc}", 502) from None
        return i
