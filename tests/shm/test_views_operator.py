"""availability/inspect as an operator and a monitor use them: --check, pipes, JSON errors,
removing an unsafe segment. Real sidecars, real signals, real pipes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gwtest import run_cli, wait_until

from shm_layout.segment import Segment

CLI = str(Path(sys.executable).with_name("gateway-capacity"))


@pytest.fixture
def sidecar(
    segment_name: str, write_config: Callable[..., Path]
) -> Iterator[Callable[[dict[str, object]], subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []

    def start(doc: dict[str, object]) -> subprocess.Popen[str]:
        cfg = write_config(doc)
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway_capacity", "sidecar", "--config", str(cfg),
             "--segment", segment_name, "--refresh", "0.3"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
        )  # fmt: skip
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(timeout=20)


def check(segment: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli("availability", "--segment", segment, "--check", *extra)


def test_check_is_0_while_the_sidecar_runs_and_1_once_it_was_killed(
    segment_name: str, sidecar: Callable[[dict[str, object]], subprocess.Popen[str]]
) -> None:
    proc = sidecar({"providers": [{"id": "static", "maxConcurrent": 3}]})
    assert wait_until(lambda: check(segment_name).returncode == 0, timeout=30)
    assert check(segment_name).stdout.startswith(f"ok: segment {segment_name}, sidecar pid")

    proc.kill()
    proc.wait(timeout=10)
    out = check(segment_name)
    assert out.returncode == 1
    line = out.stdout.strip()
    assert line.startswith(f"sidecar pid {proc.pid} died without stopping (crashed or killed): ")
    assert "start it again ('gateway-capacity sidecar --config " in line  # what to do
    assert line.endswith("its log says why it died")
    text = run_cli("availability", "--segment", segment_name).stdout
    assert "died without stopping (crashed or killed)" in text
    assert "(dead, running)" not in text


def test_check_is_1_while_the_sidecar_is_stopped_and_0_after_it_continues(
    segment_name: str, sidecar: Callable[[dict[str, object]], subprocess.Popen[str]]
) -> None:
    proc = sidecar({"providers": [{"id": "static"}]})
    assert wait_until(lambda: check(segment_name).returncode == 0, timeout=30)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        # alive (R-A5: a paused process is alive) but its heartbeat ages: stale
        assert wait_until(
            lambda: check(segment_name, "--max-heartbeat-age", "1").returncode == 1, timeout=30
        )
        out = check(segment_name, "--max-heartbeat-age", "1")
        assert f"sidecar pid {proc.pid} is stale: last heartbeat" in out.stdout
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert wait_until(lambda: check(segment_name).returncode == 0, timeout=30)


def test_check_is_1_when_a_provider_fell_back_after_failing_discovery(
    segment_name: str,
    sidecar: Callable[[dict[str, object]], subprocess.Popen[str]],
    key_file: Path,
) -> None:
    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sidecar(
        {
            "maxConcurrent": 5,
            "providers": [
                {
                    "id": "li",
                    "baseUrl": f"http://127.0.0.1:{port}/v1",
                    "credentialFile": str(key_file),
                    "capacityDiscovery": True,
                    "models": {"w": "workhorse"},
                },
                {"id": "static", "maxConcurrent": 2},
            ],
        }
    )
    assert wait_until(
        lambda: "provider li: discovery failed" in check(segment_name).stdout, timeout=30
    )
    out = check(segment_name, "--json")
    assert out.returncode == 1
    doc = json.loads(out.stdout)
    assert doc["ok"] is False
    assert len(doc["problems"]) == 1  # the sidecar is fine; "static" is not a problem
    assert doc["problems"][0].startswith("provider li: discovery failed, on fallback 5 (gateway)")


def test_a_reason_longer_than_the_segment_keeps_is_shown_whole_in_every_view(
    segment_name: str,
    sidecar: Callable[[dict[str, object]], subprocess.Popen[str]],
    tmp_path: Path,
    key: str,
) -> None:
    """The segment's field cuts a reason at 128 bytes; the views show the sidecar's whole
    text (from its reasons file), so the fix it names can be pasted."""
    deep = tmp_path / ("keys-of-the-local-inference-farm-" * 3) / "provider-credential"
    deep.mkdir(parents=True)
    key_path = deep / "local-inference.key"
    key_path.write_text(key + "\n")
    key_path.chmod(0o644)  # refused: readable by others; the reason names the chmod
    sidecar(
        {
            "providers": [
                {
                    "id": "li",
                    "baseUrl": "http://127.0.0.1:9/v1",
                    "credentialFile": str(key_path),
                    "capacityDiscovery": True,
                    "models": {"w": "workhorse"},
                }
            ]
        }
    )
    fix = f"chmod 600 {key_path}"
    assert wait_until(lambda: fix in check(segment_name).stdout, timeout=30)
    line = check(segment_name).stdout.strip()
    assert line.endswith("tries it now"), line  # the line ends with what to do
    plain = run_cli("availability", "--segment", segment_name).stdout
    assert fix in plain
    doc = json.loads(run_cli("availability", "--segment", segment_name, "--json").stdout)
    (reason,) = [p["reason"] for p in doc["providers"] if p["id"] == "li"]
    assert fix in reason and len(reason.encode()) > 128
    assert json.loads(check(segment_name, "--json").stdout)["problems"][0].count(fix) == 1
    for out in (line, plain, reason):
        assert key not in out


def test_check_is_1_while_the_config_on_disk_is_broken_and_0_once_fixed(
    segment_name: str, sidecar: Callable[[dict[str, object]], subprocess.Popen[str]]
) -> None:
    """The sidecar keeps the last good config (R-C3); the handlers that attach meanwhile
    refuse the file, so the check fails naming it and how to find what is wrong."""
    sidecar({"providers": [{"id": "static", "maxConcurrent": 3}]})
    assert wait_until(lambda: check(segment_name).returncode == 0, timeout=30)
    config = Path(json.loads(run_cli("availability", "--segment", segment_name, "--json")
                              .stdout)["config_path"])  # fmt: skip
    config.write_text('{"providers": [\n  {"id": "static", "maxConcurrent": 3},\n]}')
    assert wait_until(lambda: check(segment_name).returncode == 1, timeout=30)
    out = check(segment_name, "--json")
    (problem,) = json.loads(out.stdout)["problems"]
    assert problem.startswith(f"config {config}: broken edit ignored, last good config kept")
    assert "line 3, column 1" in problem  # where the trailing comma's error is
    assert f"'gateway-capacity check-config --config {config}'" in problem
    config.write_text('{"providers": [{"id": "static", "maxConcurrent": 3}]}')
    assert wait_until(lambda: check(segment_name).returncode == 0, timeout=30)


def test_check_warns_with_exit_4_of_a_provider_held_at_limit_0(
    segment_name: str, sidecar: Callable[[dict[str, object]], subprocess.Popen[str]]
) -> None:
    """A static limit of 0 (or every worker fenced) may be meant; it admits nothing."""
    sidecar({"providers": [{"id": "off", "maxConcurrent": 0}, {"id": "on", "maxConcurrent": 2}]})
    assert wait_until(lambda: check(segment_name).returncode == 4, timeout=30)
    out = check(segment_name)
    assert out.stdout.startswith("warning: provider off: limit 0 (provider): "), out.stdout
    assert "it admits nothing" in out.stdout and len(out.stdout.splitlines()) == 1
    doc = json.loads(check(segment_name, "--json").stdout)
    assert doc["ok"] is False and doc["problems"] == [] and len(doc["warnings"]) == 1


@pytest.mark.linux("the check reads the segment's owner from /dev/shm, which macOS does not list")
def test_check_is_1_for_a_segment_of_another_user_naming_both_fixes(
    segment_name: str,
) -> None:
    """A handler of this user would refuse it (ForeignSegment, R-G6)."""
    from gwtest import segment_made_by_nobody

    segment_made_by_nobody(segment_name)
    out = check(segment_name, "--json")
    assert out.returncode == 1, out.stdout + out.stderr
    (foreign,) = [p for p in json.loads(out.stdout)["problems"] if "ForeignSegment" in p]
    assert foreign.startswith(f"segment {segment_name} belongs to nobody (uid 65534)")
    assert "GATEWAY_CAPACITY_OWNER=nobody" in foreign and "--group-shared" in foreign
    assert "--unlink --force" in foreign
    trusted = run_cli(
        "availability", "--segment", segment_name, "--check",
        env={**os.environ, "GATEWAY_CAPACITY_OWNER": "nobody"},
    )  # fmt: skip
    assert "ForeignSegment" not in trusted.stdout, trusted.stdout


def test_check_is_1_without_any_sidecar(segment_name: str) -> None:
    Segment.open(segment_name, create=True).close()
    out = check(segment_name)
    assert out.returncode == 1
    assert out.stdout.strip().startswith(
        f"no sidecar has ever written segment {segment_name}: start it again "
    )


@pytest.mark.linux("lists /dev/shm; macOS cannot list shared memory")
def test_a_segment_name_one_character_off_names_the_segment_that_exists(
    segment_name: str, sidecar: Callable[[dict[str, object]], subprocess.Popen[str]]
) -> None:
    proc = sidecar({"providers": [{"id": "static", "maxConcurrent": 3}]})
    assert wait_until(lambda: check(segment_name).returncode == 0, timeout=30)
    config = json.loads(run_cli("availability", "--segment", segment_name, "--json").stdout)[
        "config_path"
    ]
    typo = segment_name[:-1] + ("0" if segment_name[-1] != "0" else "1")
    out = run_cli("availability", "--segment", typo)
    assert out.returncode == 3
    line = out.stderr.strip()
    assert line.startswith(f"gateway-capacity: no segment {typo}: nothing has created it")
    assert f"did you mean {segment_name} (config {config}, sidecar pid {proc.pid} running" in line
    assert len(line.splitlines()) == 1

    listed = run_cli("segments", "--json")
    assert listed.returncode == 0, listed.stderr
    (mine,) = [s for s in json.loads(listed.stdout)["segments"] if s["name"] == segment_name]
    assert mine["config_path"] == config
    assert mine["sidecar"] == {"pid": proc.pid, "alive": True, "status": "running"}
    text = run_cli("segments").stdout
    assert f"{segment_name}  config {config}  sidecar pid {proc.pid} running" in text


@pytest.mark.parametrize("command", [["inspect", "--json"], ["availability"]])
def test_a_reader_that_closes_the_pipe_gets_no_traceback(
    command: list[str], segment_name: str
) -> None:
    Segment.open(segment_name, create=True).close()
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `| head` that has already exited: every write fails (EPIPE)
    try:
        proc = subprocess.run(
            [CLI, *command, "--segment", segment_name],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert proc.stderr == ""
    assert proc.returncode == 128 + signal.SIGPIPE


def test_json_mode_reports_errors_as_json_with_the_same_exit_code(segment_name: str) -> None:
    missing = run_cli("availability", "--segment", segment_name, "--json")
    assert missing.returncode == 3 and missing.stderr == ""
    error = json.loads(missing.stdout)
    assert set(error) == {"schema_version", "error"} and error["schema_version"] == 1
    assert error["error"].startswith(
        f"no segment {segment_name}: nothing has created it yet (start the sidecar or a handler)"
    )
    bad = run_cli("inspect", "--segment", "bad/slash", "--json")
    assert bad.returncode == 2 and bad.stderr == ""
    assert "must start with '/'" in json.loads(bad.stdout)["error"]
    plain = run_cli("availability", "--segment", segment_name)
    assert plain.returncode == 3 and plain.stdout == "" and plain.stderr.count("\n") == 1


@pytest.mark.linux("chmods the segment's file in /dev/shm; macOS cannot change a shm mode")
def test_unlink_force_on_a_world_accessible_segment_says_one_true_thing(
    segment_name: str,
) -> None:
    Segment.open(segment_name, create=True).close()
    os.chmod("/dev/shm" + segment_name, 0o666)
    refused = run_cli("inspect", "--segment", segment_name, "--unlink")
    assert refused.returncode == 2
    assert "add --force" in refused.stderr and "refusing to use it" not in refused.stderr
    assert os.path.exists("/dev/shm" + segment_name)

    forced = run_cli("inspect", "--segment", segment_name, "--unlink", "--force")
    assert forced.returncode == 0, forced.stderr
    assert forced.stderr == ""
    assert forced.stdout.strip() == (
        f"removed segment {segment_name} and its semaphores without reading it "
        f"(segment {segment_name} is accessible to all users (mode 666))"
    )
    assert not os.path.exists("/dev/shm" + segment_name)
