"""The sidecar's systemd unit: it verifies cleanly, its exposure stays where we
measured it, and it keeps the settings the shared segment depends on.

What the verify test adjusts, and why (everything else is the file as shipped):

- ExecStart= is rewritten to this venv's real ``gateway-capacity``: ``verify``
  fails when the binary does not exist, and /opt/gateway-capacity is an install
  location, not part of a checkout.
- The template is verified as the instance ``gateway-capacity-sidecar@demo.service``
  so that every ``%i`` is expanded as on a real host.
- Nothing else. ``verify`` does not resolve User=/Group= (measured with
  systemd 252: no ``gateway-capacity`` user exists on the test machine and
  verify is silent about it; the user is created at install time), and the unit's
  only Documentation= is a file: URL, so ``--man`` has no man page to look up.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from sdunit_helpers import INSTALLED_EXEC, INSTANCE, UNIT_TEMPLATE, installable_unit

pytestmark = pytest.mark.linux("systemd: the unit is Linux's (a Mac starts the sidecar as a child)")

# Measured with systemd 252 (Debian 12): "Overall exposure level ... 1.4 OK"
# (1.3 with PrivateUsers=yes, which the owner checks cannot live with: below).
# --threshold counts tenths (14 passes, 13 fails), so 14 is the measured
# score itself: any weakening of the sandbox fails this test. Raise it only
# together with a reason in JUSTIFIED_EXPOSURES.
EXPOSURE_THRESHOLD = 14

# Every check `systemd-analyze security` reports as unmet, and why it must stay so.
JUSTIFIED_EXPOSURES = {
    "PrivateNetwork": "probes reach providers on loopback and the tailnet; --metrics-listen",
    "IPAddressDeny": "resolvers and Prometheus scrapers vary per site (docs/systemd.md drop-in)",
    "RestrictAddressFamilies_AF_INET_INET6": "probes and the metrics listener",
    "RestrictAddressFamilies_AF_UNIX": "NOTIFY_SOCKET and Tailscale's LocalAPI socket",
    "RemoveIPC": "RemoveIPC=yes deletes the segment and semaphores under the handlers (R-G5)",
    "ProtectProc": "holder liveness reads /proc/PID/stat of other users' processes (R-A5)",
    "ProcSubset": "psutil and the Prometheus process metrics read /proc/stat",
    "RootDirectoryOrRootImage": "runs the installed venv from the host file system",
    "DeviceAllow": "char-rtc:r is what ProtectClock=yes itself adds",
    "PrivateUsers": "the owner checks compare real uids: in a user namespace the --owner "
    "user's segment and pidfile show as nobody's, like any other user's (R-G6)",
}

# Checks that must hold: they are what makes this unit safe to run next to the handlers.
REQUIRED = (
    "UserOrDynamicUser",
    "NotifyAccess",
    "ProtectSystem",
    "ProtectHome",
    "PrivateDevices",
    "PrivateTmp",
    "NoNewPrivileges",
    "UMask",
    "RestrictAddressFamilies_AF_PACKET",
    "RestrictAddressFamilies_AF_NETLINK",
    "RestrictAddressFamilies_OTHER",
    "CapabilityBoundingSet_CAP_SYS_ADMIN",
    "SystemCallFilter_privileged",
)


def _verify(systemd_analyze: str, unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [systemd_analyze, "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=unit.parent,
    )


def _settings(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) for every assignment, in order; comments dropped."""
    section = ""
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        assert not line.endswith("\\"), "continuation lines are not expected in this unit"
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def _values(key: str) -> list[str]:
    return [v for s, k, v in _settings(UNIT_TEMPLATE.read_text()) if k == key]


def test_unit_verifies_with_no_output_at_all(systemd_analyze: str, unit_copy: Path) -> None:
    result = _verify(systemd_analyze, unit_copy)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


@pytest.mark.parametrize(
    ("good", "bad", "expected"),
    [
        ("\nProtectSystem=strict\n", "\nProtectSytem=strict\n", "ProtectSytem"),
        ("\nRestartSec=5s\n", "\nRestartSec=soon\n", "soon"),
    ],
    ids=["misspelt-key", "bad-value"],
)
def test_verify_check_reports_a_broken_unit(
    systemd_analyze: str, venv_executable: str, tmp_path: Path, good: str, bad: str, expected: str
) -> None:
    """The check above can fail. systemd-analyze exits 0 on both of these (it
    ignores the line and warns), which is why any output at all is a failure."""
    text = installable_unit(UNIT_TEMPLATE.read_text(), venv_executable)
    assert text.count(good) == 1
    (tmp_path / UNIT_TEMPLATE.name).write_text(text.replace(good, bad))
    result = _verify(systemd_analyze, tmp_path / INSTANCE)
    assert expected in result.stdout + result.stderr


def test_verify_check_reports_a_missing_executable(systemd_analyze: str, tmp_path: Path) -> None:
    (tmp_path / UNIT_TEMPLATE.name).write_text(UNIT_TEMPLATE.read_text())
    result = _verify(systemd_analyze, tmp_path / INSTANCE)
    assert INSTALLED_EXEC in result.stdout + result.stderr


def test_security_exposure_is_within_the_measured_threshold(
    systemd_analyze: str, unit_copy: Path
) -> None:
    result = subprocess.run(
        [
            systemd_analyze,
            "security",
            "--offline=true",
            f"--threshold={EXPOSURE_THRESHOLD}",
            "--no-pager",
            str(unit_copy),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=unit_copy.parent,
    )
    score = re.search(r"Overall exposure level for \S+: (\d+\.\d)", result.stdout)
    assert score, result.stdout + result.stderr
    assert result.returncode == 0, (
        f"exposure {score.group(1)} is above {EXPOSURE_THRESHOLD / 10}:\n{result.stdout}"
    )
    # Keep the threshold tight: an improvement lowers it, so a later
    # weakening cannot hide in the slack.
    assert round(float(score.group(1)) * 10) == EXPOSURE_THRESHOLD, (
        f"exposure is now {score.group(1)}: set EXPOSURE_THRESHOLD to match"
    )


def test_docs_systemd_states_the_score_this_suite_pins() -> None:
    """docs/systemd.md quotes the exposure score: it must be the one measured here."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "systemd.md").read_text()
    said = re.findall(r"rates the unit\s+\*\*(\d+\.\d) ", page)
    assert said == [f"{EXPOSURE_THRESHOLD / 10:.1f}"], said
    without, with_ = re.findall(r"scores the unit\s+(\d+\.\d) without it \((\d+\.\d) with", page)[0]
    assert without == f"{EXPOSURE_THRESHOLD / 10:.1f}" and float(with_) < float(without)


def test_security_every_unmet_check_is_justified_and_the_key_ones_hold(
    systemd_analyze: str, unit_copy: Path
) -> None:
    result = subprocess.run(
        [systemd_analyze, "security", "--offline=true", "--json=short", str(unit_copy)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=unit_copy.parent,
        check=True,
    )
    checks = {c["json_field"]: c for c in json.loads(result.stdout)}
    unmet = {name: c["description"] for name, c in checks.items() if c["set"] is False}
    unexplained = {n: d for n, d in unmet.items() if n not in JUSTIFIED_EXPOSURES}
    assert not unexplained, f"unmet and not justified: {unexplained}"
    for name in REQUIRED:
        assert checks[name]["set"] is True, f"{name}: {checks[name]['description']}"


def test_r_g5_unit_never_removes_the_segment_under_the_handlers() -> None:
    """RemoveIPC=yes, and DynamicUser= (which implies it), delete every POSIX shm
    object and semaphore of the unit's user or group when the unit stops."""
    assert _values("RemoveIPC") == ["no"]
    assert _values("DynamicUser") == []
    assert _values("User") == ["gateway-capacity"]
    assert _values("Group") == ["gateway-capacity"]


def test_r_g6_unit_sees_the_real_owner_of_every_object() -> None:
    """The segment and --await-legacy pidfile checks trust root, the sidecar's user
    and the --owner user by uid. PrivateUsers=yes would map every other user to
    nobody inside the unit: the --owner user's objects would look like anyone's
    and be refused, and could not be told from a stranger's."""
    assert _values("PrivateUsers") in ([], ["no"])
    assert _values("User") == ["gateway-capacity"]  # and not root: no user namespace needed


def test_r_a5_unit_keeps_other_users_processes_and_dev_shm_visible() -> None:
    assert _values("ProtectProc") == []  # "invisible" would make live handlers look dead
    assert _values("PrivateIPC") == []
    assert _values("PrivateDevices") == ["yes"]  # keeps the host's /dev/shm bind-mounted
    assert _values("ProtectSystem") == ["strict"]  # /dev stays an API file system
    for key in ("InaccessiblePaths", "TemporaryFileSystem", "BindPaths", "ReadOnlyPaths"):
        assert not any("/dev" in v for v in _values(key)), key


def test_r_g6_unit_creates_owner_only_objects_and_notifies_systemd() -> None:
    assert _values("UMask") == ["0077"]
    assert _values("Type") == ["notify"]
    assert _values("NotifyAccess") == ["main"]
    assert _values("Restart") == ["on-failure"]
    (watchdog,) = _values("WatchdogSec")
    assert re.fullmatch(r"\d+s", watchdog)
    assert _values("RestrictAddressFamilies") == ["AF_UNIX AF_INET AF_INET6"]
    assert any(v.startswith("key:/etc/gateway-capacity/keys/%i") for v in _values("LoadCredential"))


def test_unit_runs_the_sidecar_for_the_instance_config_without_parent_pid() -> None:
    (exec_start,) = _values("ExecStart")
    argv = exec_start.split()
    assert argv[:4] == [
        INSTALLED_EXEC,
        "sidecar",
        "--config",
        "/etc/gateway-capacity/%i.json",
    ]
    assert "--parent-pid" not in argv


def test_unit_reloads_by_sighup_and_does_not_loop_on_a_missing_key_directory() -> None:
    """systemctl reload = SIGHUP, which the sidecar takes as "re-read the config";
    exit 243 (CREDENTIALS: LoadCredential= cannot read the key directory) is not
    restarted, so the start fails at once as docs/systemd.md says. Both are
    exercised under a real systemd in test_nspawn.py."""
    assert _values("ExecReload") == ["/bin/kill -HUP $MAINPID"]
    (prevent,) = _values("RestartPreventExitStatus")
    assert set(prevent.split()) == {"2", "243"}
