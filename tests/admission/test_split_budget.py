"""One gateway, two paths, two budgets: made visible, with a real sidecar.

The sidecar reads the config at one path; a handler names it through a symlink,
so the names derive to two segments. ``availability`` shows the config path each
segment was made for, and the handler logs one WARNING naming both segments.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from gwtest import run_cli, wait_until

from shm_layout.names import segment_name_for_config
from shm_layout.segment import unlink_segment

HANDLER = """
import logging, sys
from handler_shim import Admission
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
for _ in range(int(sys.argv[2])):
    Admission.attach(config=sys.argv[1], generation="split-test").close()
"""


def attach_as_handler(config: Path, times: int = 1) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_CAPACITY_SEGMENT"}
    out = subprocess.run(
        [sys.executable, "-c", HANDLER, str(config), str(times)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    return out.stderr


@pytest.fixture
def two_paths(tmp_path: Path) -> Iterator[tuple[Path, Path, list[str]]]:
    real = tmp_path / "etc" / "gateway.json"
    real.parent.mkdir()
    tag = secrets.token_hex(4)  # provider ids no other test's sidecar has
    real.write_text(
        json.dumps({"providers": [{"id": f"a-{tag}", "maxConcurrent": 3}, {"id": f"b-{tag}"}]})
    )
    link = tmp_path / "release" / "gateway.json"
    link.parent.mkdir()
    link.symlink_to(real)
    names = [segment_name_for_config(real), segment_name_for_config(link)]
    assert names[0] != names[1]
    yield real, link, names
    for name in names:
        unlink_segment(name)


@pytest.mark.linux("finds the other segment by listing shared memory (/dev/shm); macOS cannot")
def test_handler_on_another_path_warns_once_and_availability_shows_each_config_path(
    two_paths: tuple[Path, Path, list[str]],
) -> None:
    real, link, (sidecar_segment, handler_segment) = two_paths
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_CAPACITY_SEGMENT"}
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "gateway_capacity", "sidecar", "--config", str(real),
         "--refresh", "0.5"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )  # fmt: skip
    try:

        def sidecar_alive() -> bool:
            out = run_cli("availability", "--segment", sidecar_segment, "--json")
            if out.returncode != 0:
                return False
            doc = json.loads(out.stdout)
            return bool(doc["sidecar"] and doc["sidecar"]["alive"])

        assert wait_until(sidecar_alive, timeout=30)
        doc = json.loads(run_cli("availability", "--segment", sidecar_segment, "--json").stdout)
        assert doc["config_path"] == os.path.abspath(real)
        text = run_cli("availability", "--segment", sidecar_segment).stdout
        assert f"config path {os.path.abspath(real)}" in text

        # the same path as the sidecar: one budget, nothing to say
        assert "has no sidecar" not in attach_as_handler(real)

        # through the symlink: a segment of its own, said once however often it attaches
        stderr = attach_as_handler(link, times=3)
        warnings = [line for line in stderr.splitlines() if "has no sidecar" in line]
        assert len(warnings) == 1, stderr
        assert warnings[0].startswith("WARNING ")
        assert handler_segment in warnings[0] and sidecar_segment in warnings[0]
        assert os.path.abspath(real) in warnings[0]
        assert "GATEWAY_CAPACITY_SEGMENT" in warnings[0]

        # and the operator sees the handler's segment was made by no sidecar
        other = json.loads(run_cli("availability", "--segment", handler_segment, "--json").stdout)
        assert other["config_path"] is None and other["sidecar"] is None
        inspect = json.loads(run_cli("inspect", "--segment", handler_segment, "--json").stdout)
        assert inspect["config_path"] is None
    finally:
        sidecar.send_signal(signal.SIGTERM)
        sidecar.wait(timeout=20)
        assert sidecar.stderr is not None
        sidecar.stderr.close()


def test_no_warning_when_no_sidecar_runs_anywhere_for_those_providers(
    two_paths: tuple[Path, Path, list[str]],
) -> None:
    real, link, _ = two_paths
    attach_as_handler(real)  # a segment without a sidecar, for the same providers
    assert "has no sidecar" not in attach_as_handler(link)
