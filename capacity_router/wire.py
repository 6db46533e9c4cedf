"""HTTP/1.1 message framing for the relay (RFC 9112), as pure functions on bytes.

The relay parses a request head and a worker's response head once each with llhttp
(Node's parser, through ``httptools``, strict: no lenient flag but a response's
``Content-Length`` beside ``Transfer-Encoding: chunked``, which is dropped for the
chunked framing), plus the checks llhttp leaves to its caller, and then only *scans* a
body for its end: a ``Content-Length`` countdown or the chunked framing
(:class:`ChunkedScanner`), so the worker's bytes go to the client as they came, never
decoded and re-encoded. llhttp cannot do that scan for a relay: it says that a message
ended (``on_message_complete``) but not where in the bytes fed (``httptools`` gives
llhttp's error position only for an upgrade), so it cannot cut a worker's answer from
what the worker wrote behind it. Anything that could frame one message two ways is
refused: ``Transfer-Encoding`` on a request (411), two ``Content-Length`` values,
obsolete line folding, a control character in a header, a head over
:data:`MAX_HEAD_BYTES`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import httptools

MAX_HEAD_BYTES = 64 << 10
MAX_HEADERS = 128

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_DIGITS = re.compile(rb"[0-9]{1,18}\Z")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}\Z")
_REASON = re.compile(rb"[\t\x20-\x7e\x80-\xff]*\Z")  # RFC 9112 4: HTAB, SP, VCHAR, obs-text
_CHUNK_EXT = re.compile(rb"[\t\x20-\x7e\x80-\xff]*\Z")  # no CR, LF, NUL, ESC in a chunk line
_WHOLE_CHUNK = re.compile(rb"([0-9A-Fa-f]{1,15})\r\n")  # a size line without an extension


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


class _Head:
    """What llhttp's callbacks give of one head."""

    __slots__ = ("headers", "status", "url")

    def __init__(self) -> None:
        self.headers: list[Header] = []
        self.url = b""
        self.status = b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_status(self, status: bytes) -> None:
        self.status += status

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= MAX_HEADERS:
            raise BadMessage(f"more than {MAX_HEADERS} header fields", 431)
        self.headers.append((name.lower(), value.strip(b" \t")))


def _parse(parser: httptools.HttpRequestParser | httptools.HttpResponseParser, head: bytes) -> None:
    """Feed ``head`` and its empty line; a refusal of llhttp's or of a callback's is raised
    as it is (``HttpParserError``, :class:`BadMessage`)."""
    try:
        parser.feed_data(head + b"\r\n\r\n")
    except httptools.HttpParserUpgrade:
        pass  # CONNECT or Upgrade: the head is whole, judged below as any other
    except httptools.HttpParserCallbackError as exc:
        if isinstance(exc.__context__, BadMessage):
            raise exc.__context__ from None
        raise


def parse_request_head(head: bytes) -> RequestHead:
    """A request head without its final empty line."""
    line = head.split(b"\r\n", 1)[0]
    if line.count(b" ") != 2:  # llhttp takes runs of spaces
        raise BadMessage("a request line that is not METHOD TARGET HTTP/1.1")
    sink = _Head()
    parser = httptools.HttpRequestParser(sink)
    try:
        _parse(parser, head)
    except httptools.HttpParserError as exc:
        if any(name == b"transfer-encoding" for name, _ in sink.headers):
            raise BadMessage(
                "a request body with Transfer-Encoding: send Content-Length", 411
            ) from None
        if str(exc) == "Invalid HTTP version":
            raise BadMessage("an HTTP version other than 1.1 or 1.0", 505) from None
        raise BadMessage(f"a request llhttp refuses: {exc}") from None
    version = parser.get_http_version()
    if version not in ("1.1", "1.0"):
        raise BadMessage("an HTTP version other than 1.1 or 1.0", 505)
    target = sink.url
    if not target.startswith(b"/") or _BAD_VALUE.search(target) or b"#" in target:
        raise BadMessage("a request target that is not an absolute path")
    headers = sink.headers
    if any(name == b"transfer-encoding" for name, _ in headers):
        raise BadMessage("a request body with Transfer-Encoding: send Content-Length", 411)
    length = content_length(headers) or 0
    method = parser.get_method().decode()
    return RequestHead(method, target.decode("latin-1"), version.encode(), headers, length)


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
    sink = _Head()
    parser = httptools.HttpResponseParser(sink)
    # a Content-Length beside chunked is dropped, the chunked framing kept (RFC 9112 6.3)
    parser.set_dangerous_leniencies(lenient_chunked_length=True)
    try:
        _parse(parser, head)
    except BadMessage as exc:
        raise BadMessage(str(exc), 502) from None
    except httptools.HttpParserError as exc:
        raise BadMessage(f"a head llhttp refuses: {exc}", 502) from None
    status = parser.get_status_code()
    version = parser.get_http_version()
    if version not in ("1.1", "1.0") or not 100 <= status <= 599:
        raise BadMessage("a status line that is not HTTP/1.1 NNN", 502)
    reason = sink.status
    if not _REASON.match(reason):  # llhttp takes a NUL or an ESC there
        raise BadMessage("a control character in the reason phrase", 502)
    headers = sink.headers
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
    keep_alive = version == "1.1" and b"close" not in tokens and (chunked or length is not None)
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
            if state == self._SIZE and not self._line:
                # the common case, a whole chunk in one read (a worker writes an event as
                # one chunk): its size line, its data and its CRLF, in one match
                whole = _WHOLE_CHUNK.match(buf, i)
                if whole is not None:
                    length = int(whole.group(1), 16)
                    start = whole.end()
                    if length and buf[start + length : start + length + 2] == b"\r\n":
                        if keep_data:
                            self._data.append(buf[start : start + length])
                        i = start + length + 2
                        continue
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
