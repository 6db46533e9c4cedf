"""CPU per probe and per publication, measured in this process.

    python bench/sidecar_costs.py --port P --key-file F [--probes N] [--publishes N]

Run with ``$GWCAP_BENCH_SOURCE`` naming another source tree (``git archive REF``)
to measure that tree: it uses ``ProbeClients`` and ``PublishCache`` when the tree
has them, as its daemon would, and the plain calls when it does not.

- probe: ``probe_provider`` of one loopback provider (one replica) against the
  farm on ``--port`` (a process of its own, so its CPU is not counted), one
  after the other; CPU (``time.process_time``) per probe, median.
- publish: ``writer.publish`` of 64 providers with 4 replicas each, every row
  changed (a new ``observed_at``, as after every refresh); CPU per call, median.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import time
from typing import Any

from bench_source import use_source_from_env

MODEL = "bench-upstream"


async def probe_costs(port: int, key_file: str, count: int) -> list[float]:
    from sidecar import probe as probe_module
    from sidecar.config import ProviderConfig

    provider = ProviderConfig(
        id="bench",
        base_url=f"http://127.0.0.1:{port}/v1",
        credential_file=key_file,
        capacity_discovery=True,
        models={"bench": MODEL},
    )
    kwargs: dict[str, Any] = {}
    clients = getattr(probe_module, "ProbeClients", None)
    if clients is not None:
        kwargs["clients"] = clients()
    costs = []
    for _ in range(count + 5):
        began = time.process_time()
        result = await probe_module.probe_provider(provider, **kwargs)
        costs.append(time.process_time() - began)
        if result.refused is not None or not all(r.ok for r in result.replicas):
            raise RuntimeError(f"probe failed: {result}")
    if "clients" in kwargs:
        await kwargs["clients"].aclose()
    return costs[5:]  # the first ones load modules and connect


def publish_costs(count: int) -> list[float]:
    from shm_layout import writer
    from shm_layout.segment import Segment, unlink_segment
    from shm_layout.view import ReplicaView

    name = "/gwb-" + secrets.token_hex(6)
    seg = Segment.open(name, create=True)
    try:
        now = time.time()
        epoch = writer.take_epoch(seg, os.getpid(), 1.0, now, 1.0, "/bench.json")
        cache_type = getattr(writer, "PublishCache", None)
        extra = (cache_type(),) if cache_type is not None else ()

        def publications(observed: float) -> list[writer.Publication]:
            return [
                writer.Publication(
                    provider_id=f"p{i}",
                    discovery=True,
                    fallback=4,
                    fallback_source="gateway",
                    limit=6,
                    reason="discovered 6, minimum of 4 complete replicas",
                    discovered=6,
                    observed_at=observed,
                    expires_at=observed + 30,
                    replicas=[
                        ReplicaView(f"127.0.0.{r + 1}", True, True, 6, "ok: loopback", observed)
                        for r in range(4)
                    ],
                )
                for i in range(64)
            ]

        costs = []
        for n in range(count + 5):
            pubs = publications(now + n)  # built outside the measurement: the daemon keeps them
            began = time.process_time()
            writer.publish(seg, epoch, 1, "ok", pubs, time.time(), *extra)
            costs.append(time.process_time() - began)
        return costs[5:]
    finally:
        seg.close()
        unlink_segment(name)


def main() -> None:
    use_source_from_env()
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--key-file", required=True)
    parser.add_argument("--probes", type=int, default=300)
    parser.add_argument("--publishes", type=int, default=200)
    args = parser.parse_args()
    probes = asyncio.run(probe_costs(args.port, args.key_file, args.probes))
    publishes = publish_costs(args.publishes)
    print(
        json.dumps(
            {
                "probe_cpu_ms": 1000 * statistics.median(probes),
                "publish_cpu_ms": 1000 * statistics.median(publishes),
                "probes": len(probes),
                "publishes": len(publishes),
            }
        )
    )


if __name__ == "__main__":
    main()
