"""The unit under a real systemd: PID 1 of a Debian 12 container.

docs/systemd.md is followed step by step inside, as root, as an operator
would: the wheel ``make wheel`` built on the host (a build machine), installed
with ``make install PREFIX=/opt/gateway-capacity WHEEL=...`` from a copy of this
checkout and with no compiler reachable (the root has gcc for other uses: PATH
and CC hide it), the system user, the config, the key directory, the unit. The
provider is the reference router (``gateway-capacity router serve``) with one
simulated worker, both on the host's loopback, which the container shares.

The container boots once for this module (the tests run in order, on one
xdist worker: ``xdist_group``) and is always powered off afterwards. Skipped,
with the reason, where the machine cannot: not root, no systemd-nspawn or
mmdebstrap (``make test`` installs them with ``scripts/ensure-tools``), or no
Debian mirror to build the root from. The first run builds the root (about a
minute) and pip downloads the runtime dependencies inside; later runs reuse
the cached root.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gwtest import provider_of
from nspawn_box import REPO, Box, BoxError, build_root, repo_files

from capacity_router import SimWorker

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))
from router_support import serve_args, worker, write_registry

pytestmark = [
    pytest.mark.xdist_group("nspawn"),
    pytest.mark.timeout(900),
    pytest.mark.linux("systemd-nspawn boots a Debian container under systemd"),
]

NAME = "demo"
UNIT = f"gateway-capacity-sidecar@{NAME}.service"
PREFIX = "/opt/gateway-capacity"
EXE = f"{PREFIX}/bin/gateway-capacity"
CONFIG = f"/etc/gateway-capacity/{NAME}.json"
ENV_FILE = f"/etc/gateway-capacity/{NAME}.env"
PIDFILE = "/run/gateway/legacy.pid"
SRC = "/usr/local/src/gateway-capacity"
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
SLOTS = 10
# Enough for every check below, short enough to keep the test quick. Group-shared mode:
# each side names the other's user as a trusted owner of the segment (R-G6).
SIDECAR_ARGS = "--group-shared --owner gateway --refresh 2"


class Provider:
    """The router on the host, fronting one simulated worker (model "workhorse")."""

    def __init__(self, directory: Path) -> None:
        self.key = "sk-nspawn-" + secrets.token_hex(12)
        self.worker = SimWorker(slots=SLOTS, model="workhorse")
        self.worker.start()
        key_file = directory / "router.key"
        key_file.write_text(self.key + "\n")
        key_file.chmod(0o600)
        registry = directory / "workers.json"
        write_registry(registry, [worker("w1", [self.worker.url], ["workhorse"])])
        exe = str(Path(sys.executable).with_name("gateway-capacity"))
        self.proc = subprocess.Popen(
            [exe, "router", *serve_args(registry, key_file), "--poll", "0.5"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        match = re.search(r"(http://127\.0\.0\.1:\d+)/v1/capacity", line)
        assert match, f"router did not say where it serves: {line!r}"
        self.base_url = match.group(1) + "/v1"

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.worker.stop()


def _skip_unless_possible() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: systemd-nspawn boots a container")
    for tool in ("systemd-nspawn", "nsenter", "mmdebstrap", "git", "tar"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (make test installs it: scripts/ensure-tools)")
    if not Path(HOST_CA).is_file():
        pytest.skip(f"no {HOST_CA} to give pip inside the container")


@pytest.fixture(scope="module")
def provider(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Provider]:
    p = Provider(tmp_path_factory.mktemp("router"))
    yield p
    p.close()


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory, provider: Provider) -> Iterator[Box]:
    _skip_unless_possible()
    try:
        root = build_root()
    except BoxError as exc:
        pytest.skip(str(exc))
    box = Box(root, tmp_path_factory.mktemp("nspawn") / "console.log")
    try:
        try:
            box.boot()
        except BoxError as exc:
            pytest.skip(f"cannot boot a systemd-nspawn container here: {exc}")
        _install_as_the_docs_say(box, provider, _wheel(tmp_path_factory.mktemp("wheelhouse")))
        yield box
    finally:
        with contextlib.suppress(Exception):  # what the sidecar said, for a failed run's log
            journal = box.run(f"journalctl -b --no-pager -n 200 -u '{UNIT}'", check=False)
            print(f"--- journal of {UNIT} ---\n{journal.stdout[-12000:]}")
        box.close()


def _wheel(directory: Path) -> Path:
    """`make wheel`, on the host: the build machine of docs/systemd.md step 1."""
    subprocess.run(
        [str(REPO / "scripts" / "build-wheel"), sys.executable, str(directory)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = directory.glob("*.whl")
    return wheel


def _install_as_the_docs_say(box: Box, provider: Provider, wheel: Path) -> None:
    """docs/systemd.md, "Install", steps 1 to 4 (step 5 is the first test)."""
    box.copy_tree(repo_files(), REPO, SRC)
    box.put("/etc/ssl/certs/host-ca.crt", Path(HOST_CA).read_bytes())
    # 1. The program, from the wheel, with no compiler on PATH (cc, gcc are stubs that fail)
    inside = f"/root/{wheel.name}"
    box.put(inside, wheel.read_bytes())
    box.run(
        "mkdir -p /root/no-cc && for c in cc gcc x86_64-linux-gnu-gcc; do "
        "printf '#!/bin/sh\\necho $0 >> /root/no-cc.log; exit 1\\n' > /root/no-cc/$c; "
        "chmod 755 /root/no-cc/$c; done"
    )
    box.run(
        f"cd {SRC} && PATH=/root/no-cc:$PATH CC=false make install PREFIX={PREFIX} WHEEL={inside}",
        env={"PIP_CERT": "/etc/ssl/certs/host-ca.crt", "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
        timeout=600,
    )
    box.run("test ! -e /root/no-cc.log")  # no compiler was tried
    # 2. The system user.
    box.run(
        "useradd --system --user-group --no-create-home --home-dir /nonexistent "
        "--shell /usr/sbin/nologin gateway-capacity"
    )
    # 3. The config, group-readable by the sidecar.
    config = {
        "maxConcurrent": 16,
        "providers": [
            {
                "id": "local-inference",
                "type": "chat-completions-api",
                "baseUrl": provider.base_url,
                "credentialFile": "systemd-credential:key_local-inference",
                "capacityDiscovery": True,
                "models": {"local-workhorse": "workhorse"},
            }
        ],
    }
    box.run("install -d -m 0755 /etc/gateway-capacity")
    box.put(CONFIG, json.dumps(config, indent=1))
    box.run(f"chgrp gateway-capacity {CONFIG} && chmod 0640 {CONFIG}")
    # 4. The keys.
    box.put("/root/local-inference.key", provider.key + "\n", mode=0o600)
    box.run(
        f"install -d -m 0700 /etc/gateway-capacity/keys/{NAME} && install -m 0600 "
        f"/root/local-inference.key /etc/gateway-capacity/keys/{NAME}/local-inference"
    )
    # The handlers' user, in the shared group ("Handlers running as another user").
    box.run(
        "useradd --system --user-group --no-create-home --home-dir /nonexistent "
        "--shell /usr/sbin/nologin gateway && usermod -a -G gateway-capacity gateway"
    )


def _availability(box: Box) -> dict[str, Any]:
    out = box.run(f"{EXE} availability --config {CONFIG} --json").stdout
    doc: dict[str, Any] = json.loads(out)
    return doc


def _provider(box: Box, pid: str = "local-inference") -> dict[str, Any]:
    return provider_of(_availability(box), pid)


def _start_holder(box: Box, unit: str) -> None:
    """A handler of the user gateway, as the unit ``unit``, holding one slot for good."""
    box.run(
        _handler(
            "with adm.slot_blocking('local-inference', timeout=10):\n    time.sleep(600)\n",
            unit=unit,
        )
    )
    box.wait("holder running", lambda: _provider(box)["running"] == 1, 30)


def _state(box: Box) -> str:
    return box.run(f"systemctl is-active {UNIT}", check=False).stdout.strip()


def _handler(script: str, *, unit: str | None = None) -> str:
    """A handler as the gateway's user with the shared primary group, as the
    gateway's own unit would run it (User=gateway, Group=gateway-capacity)."""
    code = (
        "import sys, time\n"
        "from handler_shim import Admission\n"
        f"adm = Admission.attach(config={CONFIG!r}, group_shared=True, "
        "owner='gateway-capacity')\n" + script
    )
    how = f"--unit={unit}" if unit else "--wait --pipe --quiet"
    return (
        f"systemd-run {how} -p User=gateway -p Group=gateway-capacity "
        f"{PREFIX}/bin/python -c {shlex.quote(code)}"
    )


# --- the tests, in the order an operator meets them ---------------------------------------


def test_make_install_brings_the_program_and_runtime_deps_only(box: Box) -> None:
    version = box.run(f"{EXE} --help").stdout
    assert "sidecar" in version
    pkgs = box.run(f"{PREFIX}/bin/python -m pip list --format=json").stdout
    names = {p["name"].lower().replace("_", "-") for p in json.loads(pkgs)}
    assert {"gateway-capacity", "posix-ipc", "httpx", "msgspec"} <= names
    assert not names & {"pytest", "ruff", "mypy", "hypothesis", "redis"}, names
    box.run(f"test -f {PREFIX}/share/doc/gateway-capacity/systemd.md")
    # from the wheel: the compiled core came in built, tagged for manylinux
    wheel = box.run(f"cat {PREFIX}/lib/python3*/site-packages/gateway_capacity-*.dist-info/WHEEL")
    assert "manylinux" in wheel.stdout, wheel.stdout
    # the man page and the shell completions
    box.run(f"test -f {PREFIX}/share/man/man1/gateway-capacity.1")
    box.run(f"test -f {PREFIX}/share/bash-completion/completions/gateway-capacity")
    box.run(f"test -f {PREFIX}/share/zsh/site-functions/_gateway-capacity")


def test_unit_is_active_only_after_ready_and_awaits_a_legacy_process(box: Box) -> None:
    """docs step 5, during an upgrade (--await-legacy, "Lifecycle"), with
    systemd.md's first example as printed: the legacy gateway runs as the user
    ``gateway`` (the --owner user) and writes its pidfile in its own
    ``RuntimeDirectory=gateway``, the ordinary way. The sidecar sends READY=1
    only once it publishes, which is after that pidfile appeared; until then
    the unit is "activating" (R-G3, R-G6)."""
    box.put(ENV_FILE, f'GATEWAY_CAPACITY_ARGS="{SIDECAR_ARGS} --await-legacy {PIDFILE}"\n')
    box.run(f"install -m 0644 {SRC}/systemd/gateway-capacity-sidecar@.service /etc/systemd/system/")
    box.run("systemctl daemon-reload")
    box.run(f"systemctl enable --now --no-block {UNIT}")
    box.wait("sidecar process started", lambda: box.show(UNIT, "MainPID")["MainPID"] != "0", 30)
    time.sleep(2.0)  # well inside the 10 s pidfile grace
    assert _state(box) == "activating"
    assert box.show(UNIT, "StatusText")["StatusText"] == ""
    # the legacy gateway, as its own user, writing its pidfile where it may
    box.put(
        "/usr/local/bin/legacy-gateway",
        f"#!/bin/sh\necho $$ > {PIDFILE}\nexec sleep 600\n",
        mode=0o755,
    )
    box.run(
        "systemd-run --unit=legacy-gateway -p User=gateway -p RuntimeDirectory=gateway "
        "/usr/local/bin/legacy-gateway"
    )
    pid = box.show("legacy-gateway.service", "MainPID")["MainPID"]
    box.wait(
        "pidfile written", lambda: box.run(f"cat {PIDFILE}", check=False).stdout.strip() == pid, 10
    )
    owners = box.run(f"stat -c %U {PIDFILE} /run/gateway").stdout.split()
    assert owners == ["gateway", "gateway"], owners
    box.wait("unit active", lambda: _state(box) == "active", 30)
    p = _provider(box)
    assert (p["source"], p["effective_limit"]) == ("legacy_drain", 0), p
    assert _availability(box)["sidecar"]["legacy_alive"] == 1
    box.run("systemctl stop legacy-gateway.service")
    box.wait("drain over", lambda: _provider(box)["source"] == "discovered", 30)
    # the upgrade is done: remove the line, restart
    box.put(ENV_FILE, f'GATEWAY_CAPACITY_ARGS="{SIDECAR_ARGS}"\n')
    box.run(f"systemctl restart {UNIT}")
    assert _state(box) == "active"


def test_availability_shows_the_discovered_limit_and_a_live_sidecar(
    box: Box, provider: Provider
) -> None:
    doc = _availability(box)
    p = next(p for p in doc["providers"] if p["id"] == "local-inference")
    assert (p["source"], p["effective_limit"]) == ("discovered", SLOTS), p
    assert doc["sidecar"]["alive"] is True and doc["sidecar"]["state"] == "running", doc
    mode = box.run("stat -c '%a %U %G' /dev/shm" + doc["segment"]).stdout.split()
    assert mode == ["660", "gateway-capacity", "gateway-capacity"], mode
    # systemctl status shows the limits (STATUS=), and follows a change
    status = box.show(UNIT, "StatusText")["StatusText"]
    assert status == f"local-inference={SLOTS} (discovered)", status
    provider.worker.set_slots(6)
    try:
        box.wait(
            "STATUS= follows the new limit",
            lambda: box.show(UNIT, "StatusText")["StatusText"] == "local-inference=6 (discovered)",
            30,
        )
        assert "local-inference=6" in box.run(f"systemctl status --no-pager {UNIT}").stdout
    finally:
        provider.worker.set_slots(SLOTS)
    box.wait("limit back", lambda: _provider(box)["effective_limit"] == SLOTS, 30)


def test_handler_as_another_user_attaches_and_takes_a_slot(box: Box) -> None:
    out = box.run(
        _handler(
            "with adm.slot_blocking('local-inference', timeout=10):\n"
            "    print('admitted', flush=True)\n"
            "adm.close()\n"
        )
    )
    assert out.stdout.strip() == "admitted", out


def test_a_live_holder_of_another_user_is_never_reaped_and_a_dead_one_is(box: Box) -> None:
    """The sandbox lets the sidecar judge other users' processes (/proc)."""
    _start_holder(box, "gwcap-holder")
    time.sleep(3.0)  # six housekeeping turns, each of which reaps dead holders
    assert _provider(box)["running"] == 1
    journal = box.run(f"journalctl -u {UNIT} --no-pager -o cat").stdout
    assert "reclaimed" not in journal
    box.run("systemctl kill -s KILL gwcap-holder.service")
    box.wait("dead holder reclaimed", lambda: _provider(box)["running"] == 0, 30)


def test_stop_leaves_the_segment_and_a_restart_reattaches(box: Box) -> None:
    _start_holder(box, "gwcap-holder2")
    before = _availability(box)
    box.run(f"systemctl stop {UNIT}")
    box.run("test -e /dev/shm" + before["segment"])  # RemoveIPC=no
    after_stop = _availability(box)
    assert after_stop["sidecar"]["alive"] is False, after_stop["sidecar"]
    p = provider_of(after_stop, "local-inference")
    assert p["running"] == 1
    box.run(f"systemctl start {UNIT}")
    again = _availability(box)
    assert again["segment"] == before["segment"]
    assert again["sidecar"]["alive"] is True
    assert again["sidecar"]["writer_epoch"] > before["sidecar"]["writer_epoch"]
    p = provider_of(again, "local-inference")
    assert p["running"] == 1 and p["effective_limit"] == SLOTS, p
    box.run("systemctl stop gwcap-holder2.service")
    box.wait("slot released", lambda: _provider(box)["running"] == 0, 30)


def test_reload_rereads_the_config_without_a_restart(box: Box) -> None:
    before = box.show(UNIT, "MainPID", "NRestarts")
    config = json.loads(box.run(f"cat {CONFIG}").stdout)
    config["providers"].append({"id": "static-two", "maxConcurrent": 4})
    # written in place (same inode, so the stamp may not change within a tick): reload
    box.run(f"cat > {CONFIG}", stdin=json.dumps(config).encode())
    box.run(f"systemctl reload {UNIT}")
    box.wait(
        "static-two published",
        lambda: any(
            p["id"] == "static-two" and p["effective_limit"] == 4
            for p in _availability(box)["providers"]
        ),
        15,
    )
    box.run(f"systemctl kill -s HUP {UNIT}")  # a bare HUP must not stop the unit either
    time.sleep(1.0)
    assert _state(box) == "active"
    assert box.show(UNIT, "MainPID", "NRestarts") == before
    journal = box.run(f"journalctl -u {UNIT} --no-pager -o cat").stdout
    assert "received SIGHUP" in journal
    status = box.show(UNIT, "StatusText")["StatusText"]
    assert status == f"local-inference={SLOTS} (discovered), static-two=4 (provider)", status


def test_watchdog_kills_a_stopped_sidecar_and_systemd_restarts_it(box: Box) -> None:
    before = box.show(UNIT, "MainPID", "NRestarts")
    box.run(f"systemctl kill -s STOP --kill-who=main {UNIT}")
    # WatchdogSec=20s, then SIGABRT, which systemd follows with SIGCONT so that a
    # stopped process gets it, then RestartSec=5s: measured about 25 s here.
    box.wait(
        "restarted",
        lambda: (
            box.show(UNIT, "MainPID")["MainPID"] not in ("0", before["MainPID"])
            and _state(box) == "active"
        ),
        90,
    )
    after = box.show(UNIT, "NRestarts")
    assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1
    journal = box.run(f"journalctl -u {UNIT} --no-pager").stdout
    assert "Watchdog timeout" in journal
    box.wait("limit published again", lambda: _provider(box)["source"] == "discovered", 30)


def test_systemd_analyze_security_inside_is_at_most_2_0(box: Box) -> None:
    out = box.run(f"systemd-analyze security --no-pager {UNIT}", check=False).stdout
    score = re.search(r"Overall exposure level for \S+: (\d+\.\d)", out)
    assert score, out
    print(f"systemd-analyze security inside: {score.group(1)}")
    assert float(score.group(1)) <= 2.0, out


def test_under_protect_proc_invisible_a_hidden_legacy_process_is_still_awaited(
    box: Box,
) -> None:
    """A drop-in with ProtectProc=invisible (against the unit's advice): the
    legacy gateway, a root process, vanishes from the sidecar's /proc. The
    sidecar says so and keeps draining until that process really exits."""
    name = "hidden"
    unit = f"gateway-capacity-sidecar@{name}.service"
    config = f"/etc/gateway-capacity/{name}.json"
    box.run(f"cp -p {CONFIG} {config}")
    box.run(f"cp -a /etc/gateway-capacity/keys/{NAME} /etc/gateway-capacity/keys/{name}")
    box.run("systemd-run --unit=legacy-hidden sleep 600")
    pid = box.show("legacy-hidden.service", "MainPID")["MainPID"]
    box.put(f"/etc/gateway-capacity/{name}.env", f'GATEWAY_CAPACITY_ARGS="--await-legacy {pid}"\n')
    box.put(f"/etc/systemd/system/{unit}.d/protect-proc.conf", "[Service]\nProtectProc=invisible\n")
    box.run("systemctl daemon-reload")
    box.run(f"systemctl start {unit}")
    try:
        out = box.run(f"{EXE} availability --config {config} --json").stdout
        p = next(p for p in json.loads(out)["providers"] if p["id"] == "local-inference")
        assert p["source"] == "legacy_drain", p
        journal = box.run(f"journalctl -u {unit} --no-pager -o cat").stdout
        assert "hidepid=invisible" in journal and "does not show it" in journal, journal
        box.run("systemctl stop legacy-hidden.service")

        def drained() -> bool:
            out = box.run(f"{EXE} availability --config {config} --json").stdout
            return any(
                p["id"] == "local-inference" and p["source"] == "discovered"
                for p in json.loads(out)["providers"]
            )

        box.wait("drain over once the hidden process exited", drained, 30)
    finally:
        box.run(f"systemctl stop {unit}", check=False)


def test_a_missing_key_directory_fails_the_start_at_once(box: Box) -> None:
    """docs step 4: "If the directory is missing, the unit fails to start with
    result 243/CREDENTIALS", and it is not restarted in a loop."""
    box.run(f"cp -p {CONFIG} /etc/gateway-capacity/nokeys.json")
    unit = "gateway-capacity-sidecar@nokeys.service"
    start = box.run(f"systemctl start {unit}", check=False)
    assert start.returncode != 0
    time.sleep(7.0)  # longer than RestartSec=5s: a restart would have happened
    shown = box.show(unit, "ActiveState", "Result", "ExecMainStatus", "NRestarts")
    assert shown == {
        "ActiveState": "failed",
        "Result": "exit-code",
        "ExecMainStatus": "243",
        "NRestarts": "0",
    }, shown
    status = box.run(f"systemctl status --no-pager {unit}", check=False).stdout
    assert "243/CREDENTIALS" in status
