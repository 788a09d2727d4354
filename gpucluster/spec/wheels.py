"""The Python wheels the in-cluster controllers of the Kubernetes flavour install at their start (the budget guardrail,
the burn-in's replacement step): boto3 and its whole dependency closure, each at one version with its wheel's sha256,
so that pip installs exactly these files (`--require-hashes --no-deps`) or nothing.

The versions are the ones this project's tests run against (the venv's boto3 1.44.8 and what it resolved). Each hash
is of the file PyPI serves, taken with `pip download --no-deps --only-binary=:all: <name>==<version> -d DIR` and
`sha256sum DIR/*.whl`; all are pure-Python wheels (py3-none-any; six and python-dateutil py2.py3-none-any), one
file per version whatever the image's Python.
To move to a new boto3: update every row the same way (tests/test_kube_wheels.py checks the closure and the pins).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Wheel:
    name: str  # the distribution's name as PyPI spells it
    version: str
    sha256: str

    def requirement(self) -> str:
        """One line of a pip requirements file in hash-checking mode."""
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}"


BOTO3 = (
    Wheel("boto3", "1.44.8", "099caf21553bbbfef118904aa02fadb8776a534704cf00bede0ed9f29a4da88e"),
    Wheel("botocore", "1.44.8", "76342a76c338701db80dcb8afe1c9bd079283d6fffbb9d881442abb02a215043"),
    Wheel("s3transfer", "0.19.3", "24eb7535804306355e31c952a90022bf5b2f9d760f9a11062c7493a217c08553"),
    Wheel("jmespath", "1.1.0", "a5663118de4908c91729bea0acadca56526eb2698e83de10cd116ae0f4e97c64"),
    Wheel("python-dateutil", "2.9.0.post0", "a8b2bc7bffae282281c8140a97d3aa9c14da0b136dfe83f850eea9a5f7470427"),
    Wheel("six", "1.17.0", "4721f391ed90541fddacab5acf947aa0d3dc7d27b2e1e8eda2be8970586c3274"),
    Wheel("urllib3", "2.8.0", "0cf3cae568d36aa9576b28dfb35f11328f1cb974ca7647d9475ebb86c75ac6e3"),
)
