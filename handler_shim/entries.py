"""The provider rows a handler creates from its own reading of the config: whoever
arrives first at a segment writes them (R-A9), so a handler admits without a sidecar
(R-A8)."""

from __future__ import annotations

import logging
import os

from shm_layout import layout

log = logging.getLogger("gateway_capacity.admission")


class ProviderEntry:
    """What a shim that creates provider rows writes from its own reading of the config."""

    __slots__ = (
        "classes",
        "default_class",
        "discovery",
        "fallback",
        "fallback_source",
        "provider_id",
    )

    def __init__(
        self,
        provider_id: str,
        fallback: int,
        fallback_source: layout.Source,
        *,
        discovery: bool,
        classes: tuple[tuple[str, int, int, int], ...] = (),
        default_class: int = 0,
    ):
        self.provider_id = provider_id
        self.fallback = fallback
        self.fallback_source = fallback_source
        self.discovery = discovery
        self.classes = classes  # admission classes as the segment holds them (writer.ClassSpec)
        self.default_class = default_class

    def __repr__(self) -> str:
        return (
            f"ProviderEntry({self.provider_id!r}, {self.fallback}, {self.fallback_source!r}, "
            f"{self.discovery})"
        )


def providers_from_config(path: str | os.PathLike[str]) -> list[ProviderEntry]:
    from gateway_config import fallback_for, read_config_file

    cfg = read_config_file(path)
    for skipped in cfg.skipped:
        log.warning("config %s: %s", cfg.source, skipped)
    out = []
    for provider in cfg.providers:
        limit, source = fallback_for(provider.max_concurrent, cfg.max_concurrent)
        stored = layout.Source(source)
        if cfg.capacity_share is not None and provider.capacity_discovery:
            # share mode: without a share in force, a provider with discovery runs 0,
            # never its static limit, which the other gateways leave no room for
            # (docs/share.md); the sidecar corrects a refused opt-in back to the static
            limit, stored = 0, layout.Source.SHARE
        out.append(
            ProviderEntry(
                provider.id,
                limit,
                stored,
                discovery=provider.capacity_discovery,
                classes=provider.class_specs,
                default_class=provider.default_class_index,
            )
        )
    return out
