"""The public IPv4 address of the machine running `pulumi up` or `preflight`, as AWS's own service sees it
(https://checkip.amazonaws.com answers the caller's address as one line of text): what `operator` in
kubernetes.public_access_cidrs stands for, and what `preflight` checks that list against.

The offline plan asks no network: gpucluster.plan sets PLANNED_ADDRESS for the program's run, as it answers the
program's other look-ups itself (gpucluster.plan.AccountFacts).
"""

from __future__ import annotations

import ipaddress
import urllib.error
import urllib.request
from collections.abc import Sequence
from contextvars import ContextVar

from gpucluster.spec.model import OPERATOR

CHECKIP_URL = "https://checkip.amazonaws.com"
TIMEOUT_S = 10
# The address `operator` stands for in this run of the Pulumi program; None (`pulumi up`, `pulumi preview`): ask
# CHECKIP_URL.
PLANNED_ADDRESS: ContextVar[str | None] = ContextVar("planned_operator_address", default=None)


class LookupFailed(Exception):
    """No public address: the service was unreachable or answered something else. The message is one line."""


def public_address(url: str = CHECKIP_URL, timeout: float = TIMEOUT_S) -> ipaddress.IPv4Address:
    """This machine's public IPv4 address as `url` answers it."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            body = reply.read(64)  # an address and a newline; more is not an address anyway
    except urllib.error.HTTPError as exc:
        exc.close()  # it holds the response and its connection
        raise LookupFailed(f"{url} answered HTTP {exc.code}") from None
    except urllib.error.URLError as exc:
        raise LookupFailed(f"{url} is unreachable: {exc.reason}") from None
    except OSError as exc:  # a timeout or a reset while reading
        raise LookupFailed(f"{url} is unreachable: {exc}") from None
    text = body.decode("ascii", "replace").strip()
    try:
        return ipaddress.IPv4Address(text)
    except ValueError:
        raise LookupFailed(f"{url} answered {text[:40]!r}, not an IPv4 address") from None


def operator_address() -> ipaddress.IPv4Address:
    """The address `operator` stands for: the plan's, or checkip's answer."""
    planned = PLANNED_ADDRESS.get()
    return ipaddress.IPv4Address(planned) if planned is not None else public_address(CHECKIP_URL)


def public_access_cidrs(entries: Sequence[str]) -> list[str]:
    """kubernetes.public_access_cidrs as EKS takes them: `operator` as the operator's /32 (looked up only when listed),
    each network once."""
    if OPERATOR not in entries:
        return list(dict.fromkeys(entries))
    operator = f"{operator_address()}/32"
    return list(dict.fromkeys(operator if entry == OPERATOR else entry for entry in entries))
