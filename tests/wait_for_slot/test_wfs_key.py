"""wait-for-slot's key: env or file, never argv, never printed (R-W3)."""

from __future__ import annotations

import os
import subprocess
import time

import psutil
import pytest

KEY = "sk-wfs-7f3a9c2e51d04b8e0a"

# a regression that turns one sample into a 600 s wait should fail fast, not hang
pytestmark = pytest.mark.timeout(60)


def target(server) -> tuple[str, ...]:
    return ("--url", server.url, "--model", "workhorse")


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def test_r_w3_key_file_with_crlf_is_sent_as_the_bearer(server, cli, gauges, key_file):
    server.require_bearer = KEY
    server.serve(gauges())
    path = key_file(KEY.encode() + b"\r\n")
    ran = cli(*target(server), "--key-file", str(path))
    assert ran.code == 0, ran.stderr
    assert server.requests[0].headers["authorization"] == f"Bearer {KEY}"


def test_r_w3_key_file_with_trailing_spaces_and_newlines(server, cli, gauges, key_file):
    server.require_bearer = KEY
    server.serve(gauges())
    assert cli(*target(server), "--key-file", str(key_file(KEY.encode() + b"  \n\n"))).code == 0


def test_r_w3_key_from_an_environment_variable(server, cli, gauges, cli_env):
    server.require_bearer = KEY
    server.serve(gauges())
    ran = cli(*target(server), "--key-env", "UPSTREAM_KEY", env=cli_env(UPSTREAM_KEY=KEY + "\r\n"))
    assert ran.code == 0, ran.stderr
    assert server.requests[0].headers["authorization"] == f"Bearer {KEY}"


def test_r_w3_without_a_key_no_authorization_header_is_sent(server, cli, gauges, cli_env):
    server.serve(gauges())
    # a key lying around in the environment is not picked up unless named
    ran = cli(*target(server), env=cli_env(UPSTREAM_KEY=KEY, OPENAI_API_KEY=KEY))
    assert ran.code == 0
    assert "authorization" not in server.requests[0].headers


def test_r_w3_wrong_key_exits_2_and_the_reason_does_not_show_it(server, cli, gauges, key_file):
    server.require_bearer = "sk-the-right-one"
    server.serve(gauges())
    ran = cli(*target(server), "--key-file", str(key_file(KEY.encode())))
    assert ran.code == 2
    assert "the server did not accept the key" in one_line(ran.stderr)
    assert KEY not in ran.stderr + ran.stdout


@pytest.mark.parametrize("mode", [0o604, 0o644, 0o606])
def test_r_w3_key_file_open_to_all_users_is_refused_like_the_probe(server, cli, key_file, mode):
    path = key_file(KEY.encode())
    path.chmod(mode)
    ran = cli(*target(server), "--key-file", str(path))
    assert ran.code == 2
    assert "chmod 600" in one_line(ran.stderr)
    assert KEY not in ran.stderr
    assert server.requests == []


def test_r_w3_group_readable_key_file_is_refused(server, cli_process, gauges, key_file):
    server.require_bearer = KEY
    server.serve(gauges())
    path = key_file(KEY.encode())
    path.chmod(0o640)
    ran = cli_process(*target(server), "--key-file", str(path), "--quiet")
    assert ran.code == 2, ran.stderr
    line = one_line(ran.stderr)  # even with --quiet
    assert "readable by its group" in line
    assert line.endswith(
        f"run: chmod 600 {path} (give wait-for-slot a copy of its own if a group must read the key)"
    )
    assert "sidecar" not in line  # wait-for-slot has none
    assert KEY not in ran.stderr


def test_r_w3_key_file_symlink_is_refused(server, cli, key_file, tmp_path):
    link = tmp_path / "link.key"
    link.symlink_to(key_file(KEY.encode()))
    ran = cli(*target(server), "--key-file", str(link))
    assert ran.code == 2
    assert "symlink" in one_line(ran.stderr)
    assert server.requests == []


def test_r_w3_key_file_fifo_is_refused_without_hanging(server, cli, tmp_path):
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo, 0o600)
    ran = cli(*target(server), "--key-file", str(fifo))  # no writer: a blocking open would hang
    assert ran.code == 2
    assert "not a regular file" in one_line(ran.stderr)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"", "empty"),
        (b" \r\n\r\n", "empty"),
        (KEY.encode() + b"\nsecond-line-secret\n", "inside the key"),
        (b"sk one two", "inside the key"),
        ("sk-caf\u00e9".encode(), "inside the key"),
    ],
    ids=["empty", "blank", "two_lines", "spaces", "non_ascii"],
)
def test_r_w3_unusable_key_file_exits_2_without_showing_its_content(
    server, cli, key_file, content, words
):
    ran = cli(*target(server), "--key-file", str(key_file(content)))
    assert ran.code == 2
    assert words in one_line(ran.stderr)
    for piece in content.split():
        if len(piece) > 3:
            assert piece.decode(errors="replace") not in ran.stderr
    assert server.requests == []


def test_r_w3_missing_key_file_exits_2(server, cli, tmp_path):
    ran = cli(*target(server), "--key-file", str(tmp_path / "absent.key"))
    assert ran.code == 2
    assert "cannot be opened" in one_line(ran.stderr)
    assert server.requests == []


def test_r_w3_unset_or_empty_key_env_exits_2(server, cli, cli_env):
    ran = cli(*target(server), "--key-env", "NOT_SET_ANYWHERE")
    assert (ran.code, one_line(ran.stderr).endswith("is not set")) == (2, True)
    ran = cli(*target(server), "--key-env", "EMPTY_KEY", env=cli_env(EMPTY_KEY="\r\n"))
    assert (ran.code, one_line(ran.stderr).endswith("is empty")) == (2, True)
    assert server.requests == []


def test_r_w3_a_key_given_to_key_env_by_mistake_is_not_echoed(server, cli):
    ran = cli(*target(server), "--key-env", KEY)
    assert ran.code == 2
    assert "NAME of an environment variable" in one_line(ran.stderr)
    assert KEY not in ran.stderr
    assert server.requests == []


@pytest.mark.parametrize(
    "argv",
    [
        ("--key", KEY),
        (f"--key={KEY}",),
        ("--api-key", KEY),
        ("--token", KEY),
    ],
    ids=["key", "key_equals", "api_key", "token"],
)
def test_r_w3_a_key_in_argv_is_refused_without_echoing_it(server, cli, gauges, argv):
    server.serve(gauges())
    ran = cli(*target(server), *argv)
    assert ran.code == 2
    assert "a key on the command line is refused" in one_line(ran.stderr)
    assert "--key-env" in ran.stderr
    assert KEY not in ran.stderr + ran.stdout
    assert server.requests == []


def test_r_w3_key_env_and_key_file_together_is_a_usage_error(server, cli, key_file, cli_env):
    path = key_file(KEY.encode())
    ran = cli(*target(server), "--key-env", "K", "--key-file", str(path), env=cli_env(K=KEY))
    assert ran.code == 2
    assert "not both" in one_line(ran.stderr)


def test_r_w3_secret_repr_hides_the_key():
    from gateway_capacity.wait_for_slot import key_from_env

    os.environ["WFS_TEST_KEY"] = KEY
    try:
        secret = key_from_env("WFS_TEST_KEY")
    finally:
        del os.environ["WFS_TEST_KEY"]
    assert secret.reveal() == KEY
    assert KEY not in repr(secret) + str(secret) + f"{secret}" + repr([secret])


# --------------------------------------------------------------------------- real processes


def _argv_of_process_tree(pid: int) -> list[bytes]:
    """The argv of the process and every descendant, as the kernel shows it (psutil: /proc
    on Linux, sysctl on macOS), NUL-joined like /proc/PID/cmdline."""
    pids = [pid] + [child.pid for child in psutil.Process(pid).children(recursive=True)]
    found = []
    for each in pids:
        try:
            found.append(b"\0".join(a.encode() for a in psutil.Process(each).cmdline()))
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.mark.parametrize("source", ["key_file", "key_env"])
def test_r_w3_key_is_in_no_argv_and_no_output_of_the_real_command(
    server, gauges, key_file, cli_argv, cli_env, source
):
    server.require_bearer = KEY
    busy = gauges(running=[6], waiting=[2])
    server.serve(busy)
    env = cli_env()
    if source == "key_file":
        key_args = ["--key-file", str(key_file(KEY.encode() + b"\r\n"))]
    else:
        key_args = ["--key-env", "UPSTREAM_KEY"]
        env["UPSTREAM_KEY"] = KEY
    proc = subprocess.Popen(
        [*cli_argv, *target(server), *key_args, "--interval", "0.05", "--json"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        # wait until it is sampling (and so holds the key), then look at its argv
        deadline = time.monotonic() + 30
        while len(server.requests) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(server.requests) >= 2, "the command never sampled"
        argvs = _argv_of_process_tree(proc.pid)
        assert argvs, "no /proc/PID/cmdline to read"
        assert all(KEY.encode() not in argv for argv in argvs)
        server.serve(gauges(running=[0], waiting=[0]))
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert all(r.headers.get("authorization") == f"Bearer {KEY}" for r in server.requests)
    assert KEY.encode() not in stdout + stderr
    assert b"no room" in stderr  # the progress lines were there to be checked


def test_r_w3_key_is_in_no_output_when_the_server_refuses_it(server, gauges, key_file, cli_process):
    server.require_bearer = "sk-other"
    server.serve(gauges())
    ran = cli_process(*target(server), "--key-file", str(key_file(KEY.encode())), "--json")
    assert ran.code == 2
    assert KEY not in ran.stdout + ran.stderr
