"""sd_notify over a real AF_UNIX datagram socket, as systemd's manager listens.

The sending side runs in a child process whose environment carries
NOTIFY_SOCKET / WATCHDOG_USEC / WATCHDOG_PID, as a Type=notify service's would.
An AF_UNIX datagram is queued on the receiver by the time ``sendto`` returns,
so once the child has exited, "nothing was sent" is a plain empty queue: no
waiting on timeouts.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from sidecar import sdnotify


class Listener:
    """A bound datagram socket standing in for systemd's notify socket."""

    def __init__(self, address: str, env_value: str, sock: socket.socket) -> None:
        self.address = address
        self.env_value = env_value  # what NOTIFY_SOCKET says
        self.sock = sock

    def drain(self) -> list[str]:
        out = []
        while True:
            try:
                out.append(self.sock.recv(4096, socket.MSG_DONTWAIT).decode())
            except BlockingIOError:
                return out


@pytest.fixture(
    params=["path", pytest.param("abstract", marks=pytest.mark.linux("abstract socket names"))]
)
def listener(request: pytest.FixtureRequest) -> Iterator[Listener]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    # sun_path holds 108 bytes: pytest's tmp_path can be longer, so a short dir.
    directory = tempfile.mkdtemp(prefix="sdn-", dir="/tmp")
    try:
        if request.param == "path":
            address = os.path.join(directory, "notify")
            env_value = address
        else:
            name = f"gwcap-test-{secrets.token_hex(8)}"
            address, env_value = "\0" + name, "@" + name
        sock.bind(address)
        yield Listener(address, env_value, sock)
    finally:
        sock.close()
        shutil.rmtree(directory)


def run_child(
    code: str, env: Mapping[str, str], *, shell_pid_as_watchdog_pid: bool = False
) -> object:
    """Run ``code`` (which prints one JSON value) in a fresh interpreter with ``env``;
    ``sdnotify``, ``json`` and ``w`` (the environment's ``sdnotify.Watchdog``) are there.

    With ``shell_pid_as_watchdog_pid`` the interpreter is exec'd by a shell that
    first sets WATCHDOG_PID=$$, so it equals the Python process's own pid, as
    systemd sets it for the main process.
    """
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_", "WATCHDOG_"))}
    base.update(env)
    preamble = "import json\nfrom sidecar import sdnotify\nw = sdnotify.Watchdog.from_env()\n"
    argv = [sys.executable, "-c", preamble + code]
    if shell_pid_as_watchdog_pid:
        argv = ["/bin/sh", "-c", 'WATCHDOG_PID=$$ exec "$@"', "sh", *argv]
    done = subprocess.run(argv, env=base, capture_output=True, text=True, timeout=30, check=True)
    return json.loads(done.stdout)


def test_ready_watchdog_and_stopping_arrive_as_sent(listener: Listener) -> None:
    result = run_child(
        "print(json.dumps([sdnotify.ready(), w.maybe_ping(100.0), w.maybe_ping(100.5),\n"
        "                  w.maybe_ping(101.0), sdnotify.stopping()]))",
        {"NOTIFY_SOCKET": listener.env_value, "WATCHDOG_USEC": "2000000"},
    )
    # 2 s watchdog: ping at once, not again within 1 s, again at 1 s.
    assert result == [True, True, False, True, True]
    assert listener.drain() == ["READY=1", "WATCHDOG=1", "WATCHDOG=1", "STOPPING=1"]


def test_without_notify_socket_every_call_returns_false_and_sends_nothing(
    listener: Listener,
) -> None:
    result = run_child(
        "print(json.dumps([sdnotify.ready(), sdnotify.status('x'), w.enabled,\n"
        "                  w.maybe_ping(0.0), sdnotify.stopping()]))",
        {"WATCHDOG_USEC": "2000000"},  # a watchdog without a socket still sends nothing
    )
    assert result == [False, False, True, False, False]
    assert listener.drain() == []


def test_watchdog_pid_of_another_process_disables_the_watchdog(listener: Listener) -> None:
    result = run_child(
        "print(json.dumps([sdnotify.watchdog_interval(), w.maybe_ping(0.0)]))",
        {
            "NOTIFY_SOCKET": listener.env_value,
            "WATCHDOG_USEC": "2000000",
            "WATCHDOG_PID": str(os.getpid()),  # the parent's pid, not the child's
        },
    )
    assert result == [None, False]
    assert listener.drain() == []


def test_watchdog_pid_equal_to_our_own_pid_enables_the_watchdog(listener: Listener) -> None:
    result = run_child(
        "print(json.dumps([sdnotify.watchdog_interval(), w.maybe_ping(0.0)]))",
        {"NOTIFY_SOCKET": listener.env_value, "WATCHDOG_USEC": "30000000"},
        shell_pid_as_watchdog_pid=True,
    )
    assert result == [30.0, True]
    assert listener.drain() == ["WATCHDOG=1"]


def test_status_is_one_line_and_cannot_smuggle_another_assignment(
    listener: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", listener.env_value)
    assert sdnotify.status("2 providers\nREADY=1\r\nlocal-inference: 12")
    assert listener.drain() == ["STATUS=2 providers READY=1 local-inference: 12"]


@pytest.mark.parametrize(
    ("usec", "expected"),
    [
        ("20000000", 20.0),
        ("1", 0.000001),
        ("0", None),
        ("", None),
        ("-5", None),
        ("1.5", None),
        (" 20", None),
        ("abc", None),
        ("²", None),  # a digit to str.isdigit, not to int()
        (str(2**64 - 1), None),  # systemd's "infinity"
    ],
)
def test_watchdog_usec_parsing(usec: str, expected: float | None) -> None:
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": usec}) == expected


def test_watchdog_usec_absent_means_no_watchdog() -> None:
    assert sdnotify.watchdog_interval({}) is None
    assert not sdnotify.Watchdog.from_env({}).enabled
    assert sdnotify.Watchdog.from_env({}).due_in(5.0) is None


@pytest.mark.parametrize("pid", ["", "abc", "0", "-1"])
def test_unparsable_watchdog_pid_disables_the_watchdog(pid: str) -> None:
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": pid}) is None


def test_watchdog_pings_at_half_the_interval_and_retries_a_failed_send() -> None:
    sent: list[float] = []
    outcomes = iter([False, True, True])

    def send(state: str) -> bool:
        assert state == "WATCHDOG=1"
        sent.append(now)
        return next(outcomes)

    dog = sdnotify.Watchdog(10.0, send=send)
    assert dog.period == 5.0
    now = 0.0
    assert dog.due_in(now) == 0.0
    assert dog.maybe_ping(now) is False  # sent, but the send failed
    now = 4.9
    assert dog.maybe_ping(now) is False and dog.due_in(now) == pytest.approx(0.1)
    now = 5.0
    assert dog.maybe_ping(now) is True  # the retry, one period later
    now = 9.0
    assert dog.maybe_ping(now) is False
    now = 10.0
    assert dog.maybe_ping(now) is True
    assert sent == [0.0, 5.0, 10.0]


@pytest.mark.parametrize("value", ["relative/path", "vsock:2:1234", "@"])
def test_unusable_notify_socket_returns_false(value: str) -> None:
    assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": value}) is False


def test_notify_socket_with_nobody_listening_returns_false_without_raising(tmp_path: Path) -> None:
    missing = tmp_path / "gone"
    assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": str(missing)}) is False
    abstract = f"@gwcap-none-{secrets.token_hex(8)}"
    assert sdnotify.notify("READY=1", {"NOTIFY_SOCKET": abstract}) is False


def test_empty_state_is_not_sent(listener: Listener) -> None:
    assert sdnotify.notify("", {"NOTIFY_SOCKET": listener.env_value}) is False
    assert listener.drain() == []


def test_module_uses_the_standard_library_only() -> None:
    code = (
        "import json, sys\n"
        "before = set(sys.modules)\n"
        "import sidecar.sdnotify\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    )
    loaded = json.loads(done.stdout)
    assert "sidecar.sdnotify" in loaded
    allowed = set(sys.stdlib_module_names) | {"sidecar"}
    assert [m for m in loaded if m.split(".")[0] not in allowed] == []
