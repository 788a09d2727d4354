"""The Kubernetes API server as a pod reaches it with its service account: the projected token, the cluster's CA,
JSON in and out, merge patches. Used by the Kubernetes flavour's in-cluster programs (queue_guardrail.py, burn_in.py),
which gpucluster/render ships in ConfigMaps with this module. Standard library only.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TIMEOUT_SECONDS = 30


@dataclass(frozen=True)
class KubeApi:
    server: str  # https://host[:port], no trailing slash
    token_file: Path = SERVICE_ACCOUNT / "token"
    ca_file: Path = SERVICE_ACCOUNT / "ca.crt"

    @classmethod
    def in_cluster(cls) -> KubeApi:
        return cls(f"https://{os.environ['KUBERNETES_SERVICE_HOST']}")

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One request; a body goes as a JSON merge patch. Raises urllib.error.HTTPError on the server's refusal."""
        # Read on every call: the kubelet rotates the projected token in place.
        headers = {"Authorization": f"Bearer {self.token_file.read_text().strip()}", "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/merge-patch+json"
        request = urllib.request.Request(f"{self.server}{path}", method=method, headers=headers,
                                         data=json.dumps(body).encode() if body is not None else None)
        context = ssl.create_default_context(cafile=str(self.ca_file))
        with urllib.request.urlopen(request, context=context, timeout=TIMEOUT_SECONDS) as response:
            answer: dict[str, Any] = json.load(response)
            return answer
