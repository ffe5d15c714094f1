"""Configs of popular models shipped with the package (shapes only, no weights), so `autoxla
plan HUB_ID` works offline for them; docs/planning.md cites each one's source on the Hub.

Stored as AutoXLA/data/model_configs/<org>--<name>/config.json, keyed by hub id.
"""
from __future__ import annotations

import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                    "model_configs")


def shipped_ids() -> list[str]:
    """Hub ids whose config ships with AutoXLA."""
    if not os.path.isdir(ROOT):
        return []
    return sorted(d.replace("--", "/", 1) for d in os.listdir(ROOT)
                  if os.path.isfile(os.path.join(ROOT, d, "config.json")))


def shipped_config_dir(hub_id: str) -> str | None:
    """The directory holding ``hub_id``'s shipped config.json (case-insensitive), or None."""
    wanted = str(hub_id).strip().lower()
    for known in shipped_ids():
        if known.lower() == wanted:
            return os.path.join(ROOT, known.replace("/", "--", 1))
    return None
