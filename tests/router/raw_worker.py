"""A worker written on a bare socket, for the relay's break tests: each POST it reads is
counted and answered with whatever bytes its script returns (a lie, a close), so a test
can make a worker that misbehaves exactly one way. ``GET`` (the poll's health) is
answered ``200 ok``."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable

# (number of this POST on its connection from 1, the request head, its body) -> the bytes
# to answer, or None to close the connection without a word.
Script = Callable[[int, bytes, bytes], bytes | None]


def ok(body: bytes = b"{}") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


class BareServer:
    """A server on a bare socket on 127.0.0.1, port 0: each connection it accepts is
    served by ``_serve`` (a subclass's) on a thread of its own, from the start."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        """Close the listener and shut every connection it accepted."""
        self._listener.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)


class RawWorker(BareServer):
    def __init__(self, script: Script, *, die: bool = False, one_answer: bool = False) -> None:
        """``die``: a script's None also closes the listener (the worker's process died);
        ``one_answer``: each connection is closed after its first answer (a keep-alive
        timer that fired)."""
        self.script = script
        self.die = die
        self.one_answer = one_answer
        self.posts: list[bytes] = []  # every POST body read, in order
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            data = bytearray()
            posts = 0
            while True:
                try:
                    chunk = conn.recv(1 << 20)
                except OSError:
                    return
                if not chunk:
                    return
                data += chunk
                while (end := data.find(b"\r\n\r\n")) >= 0:
                    head = bytes(data[:end])
                    if not head.startswith(b"POST"):
                        del data[: end + 4]
                        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        continue
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                    if len(data) < end + 4 + length:
                        break
                    body = bytes(data[end + 4 : end + 4 + length])
                    del data[: end + 4 + length]
                    posts += 1
                    self.posts.append(body)
                    answer = self.script(posts, head, body)
                    if answer is None:
                        if self.die:
                            self.stop()
                        return
                    conn.sendall(answer)
                    if self.one_answer:
                        return
