"""The router's answer as the gateway sees it: the sidecar's own probe reads it (R-K5, R-L2).

Only the tests join the two sides; ``capacity_router`` itself shares nothing
with ``sidecar`` but the contract types.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from router_support import worker

from capacity_router import RouterServer, SimWorker
from sidecar.config import ProviderConfig
from sidecar.probe import probe_provider_sync


def test_r_k5_sidecar_probe_accepts_the_snapshot_and_sees_a_drain_and_restore(
    router: Callable[..., RouterServer],
    sim: Callable[..., SimWorker],
    key_file: Path,
    tmp_path: Path,
) -> None:
    a, b = sim(10), sim(10)
    r = router(
        [worker("a", [a.url], ["workhorse"]), worker("b", [b.url], ["workhorse"])], poll_interval=30
    )
    provider = ProviderConfig(
        id="local-inference",
        base_url=f"{r.url}/v1",
        credential_file=str(key_file),
        capacity_discovery=True,
        models={"local-workhorse": "workhorse"},
    )

    def probed() -> tuple[bool, dict[str, int]]:
        probe = probe_provider_sync(provider, tailscale_socket=str(tmp_path / "absent.sock"))
        assert probe.refused is None, probe.refused
        [replica] = probe.replicas
        assert replica.ok, (replica.reason, replica.detail)
        return replica.complete, replica.models

    assert probed() == (True, {"workhorse": 20})
    r.fence("a")
    assert probed() == (True, {"workhorse": 10})
    r.unfence("a")
    assert probed() == (True, {"workhorse": 20})
