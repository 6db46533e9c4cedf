"""Constants and text helpers shared by the systemd tests (imported by name:
this folder is put on sys.path by conftest.py, as --import-mode=importlib needs)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
UNIT_TEMPLATE = REPO / "systemd" / "gateway-capacity-sidecar@.service"
INSTALLED_EXEC = "/opt/gateway-capacity/bin/gateway-capacity"
INSTANCE = "gateway-capacity-sidecar@demo.service"
# security --offline, --threshold and --json arrived in systemd 250; the unit's
# LoadCredential= of a directory needs 251.
MIN_SYSTEMD = 251


def installable_unit(text: str, executable: str) -> str:
    """The unit text with ExecStart pointed at ``executable``: ``verify`` checks
    that the binary exists, and /opt/gateway-capacity is not installed here."""
    assert text.count(f"ExecStart={INSTALLED_EXEC} ") == 1, "ExecStart path changed"
    return text.replace(f"ExecStart={INSTALLED_EXEC} ", f"ExecStart={executable} ")
