"""The head node's Prometheus through its HTTP API (/api/v1): what `verify` asks of its targets and rules, and what
`cost` asks of the GPUs' idle hours. Standard library only."""

from __future__ import annotations

import json
import urllib.request
from typing import Any


def prometheus_get(base: str, path: str) -> Any:
    """The `data` of one answer of Prometheus' HTTP API under `base` (http://host:port)."""
    with urllib.request.urlopen(f"{base}/api/v1/{path}", timeout=10) as answer:
        return json.load(answer)["data"]
