#!/usr/bin/env python3
"""First step of every boot of a gpucluster node (gpucluster-boot.service, written by cloud-init from user data).

One SSM GetParameters call for the settings and the munge key (the first head makes it), one S3 GetObject for the
bundle (none when the one on disk is current), then the bootstrap in this node's role. AWS calls use botocore's
adaptive retries (client-side rate limiting against Parameter Store's 40 TPS when hundreds of nodes boot at once); a
failed attempt is retried with jittered backoff until DEADLINE_SECONDS, then the unit fails and systemd starts it
again. Argument: node.env (the paths). Standard library and boto3 (installed first on a stock AMI).

With `--update APPLIED_FILE` (the head's update timer, every minute): the bootstrap runs (`head --update`) only when
the settings differ from those whose SHA-256 APPLIED_FILE holds, written once applied: a `pulumi up` reaches the
running head within a minute.
"""

import base64
import hashlib
import io
import itertools
import json
import logging
import os
import random
import subprocess
import sys
import tarfile
import time
from typing import Any, Callable

DEADLINE_SECONDS = 900
RETRIED = {"ThrottlingException", "TooManyUpdates", "InternalServerError", "ServiceUnavailable", "RequestTimeout"}
log = logging.getLogger("gpucluster-fetch")


class NotYet(Exception):
    """What this boot needs is not there yet (a parameter the head node or `pulumi up` has still to write)."""


def boto3_module() -> Any:
    try:
        import boto3
    except ImportError:  # a stock AMI: the node image would have it
        apt = ["apt-get", "-o", "DPkg::Lock::Timeout=120", "-q"]
        for attempt in range(5):
            if not subprocess.call(apt + ["update"]) and not subprocess.call(apt + ["install", "-y", "python3-boto3"]):
                break
            if attempt < 4:
                time.sleep(2 ** attempt * 5)
        import boto3
    return boto3


def write_private(path: str, data: bytes, mode: int) -> None:
    """Atomically, so that a half-written file is never read."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def settings_and_key(ssm: Any, env: dict[str, str]) -> tuple[str, bytes]:
    """(settings JSON, munge key bytes) in one GetParameters call; the head creates the key if it is the first."""
    config, munge = env["GPUCLUSTER_CONFIG_PARAMETER"], env["GPUCLUSTER_MUNGE_KEY_PARAMETER"]
    found = {p["Name"]: p["Value"] for p in
             ssm.get_parameters(Names=[config, munge], WithDecryption=True)["Parameters"]}
    if config not in found:
        raise NotYet(f"no cluster settings in {config} yet")
    if munge not in found:
        if env["GPUCLUSTER_ROLE"] != "head":
            raise NotYet(f"no munge key in {munge} yet (the head node creates it)")
        key = base64.b64encode(os.urandom(1024)).decode()
        try:
            ssm.put_parameter(Name=munge, Type="SecureString", Overwrite=False, Value=key,
                              Description="gpucluster munge key (created by the head node)")
            log.info("created the munge key in %s", munge)
            found[munge] = key
        except ssm.exceptions.ParameterAlreadyExists:  # another head won the race: take its key
            found[munge] = ssm.get_parameter(Name=munge, WithDecryption=True)["Parameter"]["Value"]
    return found[config], base64.b64decode(found[munge])


def fetch_bundle(s3: Any, bucket: str, key: str, target: str, library: tuple[str, ...] = ("lib/",)) -> None:
    """Unpack the bundle (of lib/ only `library`) over the last one; files it no longer has are removed."""
    marker, listing = os.path.join(target, ".bundle-key"), os.path.join(target, ".bundle-files")
    if os.path.exists(marker) and open(marker).read() == key:
        log.debug("bundle %s already in %s", key, target)  # every minute on the head: not worth a line
        return
    try:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as exc:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code")
        if code in ("NoSuchKey", "AccessDenied"):  # `pulumi up` still writing it, or its grant not yet in force
            raise NotYet(f"no bundle s3://{bucket}/{key} yet ({code})") from exc
        raise
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and (m.name[:4] != "lib/" or m.name.startswith(library))]
        files = [m.name for m in members]
        # The "data" filter refuses links and paths out of the target; Pythons before 3.11.4 (Debian 12) lack it.
        safe: dict[str, Any] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(target, members, **safe)
    if os.path.exists(listing):
        for stale in set(open(listing).read().split()) - set(files):
            if os.path.isfile(os.path.join(target, stale)):
                os.remove(os.path.join(target, stale))
    write_private(listing, "\n".join(files).encode(), 0o644)
    write_private(marker, key.encode(), 0o644)
    log.info("bundle s3://%s/%s unpacked in %s", bucket, key, target)


def fetch(env: dict[str, str], boto3: Any, sleep: Callable[[float], None] = time.sleep) -> bytes:
    """Settings and munge key into their files, the bundle unpacked; returns the settings as fetched."""
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    config = Config(region_name=env["GPUCLUSTER_REGION"], retries={"mode": "adaptive", "max_attempts": 10})
    deadline = time.monotonic() + DEADLINE_SECONDS
    for attempt in itertools.count():
        try:
            ssm, s3 = boto3.client("ssm", config=config), boto3.client("s3", config=config)
            raw, key = settings_and_key(ssm, env)
            settings = json.loads(raw)
            fetch_bundle(s3, settings["bundle_bucket"], settings["bundle_key"], env["GPUCLUSTER_BUNDLE_DIR"],
                         tuple(env.get("GPUCLUSTER_LIBRARY", "lib/").split(":")))
            break
        except (NotYet, BotoCoreError, ClientError) as exc:
            code = exc.response["Error"]["Code"] if isinstance(exc, ClientError) else type(exc).__name__
            if isinstance(exc, ClientError) and code not in RETRIED:
                raise
            if time.monotonic() > deadline:
                raise RuntimeError(f"gave up after {DEADLINE_SECONDS} s: {exc}") from exc
            delay = random.uniform(0, min(60, 2 ** attempt))  # full jitter: booting nodes spread out
            log.warning("%s (%s); again in %.1f s", exc, code, delay)
            sleep(delay)
    write_private(env["GPUCLUSTER_SETTINGS_FILE"], raw.encode(), 0o644)
    write_private(env["GPUCLUSTER_MUNGE_KEY_FILE"], key, 0o400)
    return raw.encode()


def applied(path: str, settings: bytes) -> bool:
    """Whether the head has applied exactly these settings (and so their bundle)."""
    return os.path.exists(path) and open(path).read().strip() == hashlib.sha256(settings).hexdigest()


def main(argv: list[str]) -> int:
    env = dict(line.strip().split("=", 1) for line in open(argv[1]) if "=" in line)
    applied_file = argv[3] if len(argv) == 4 and argv[2] == "--update" else None
    os.makedirs(os.path.dirname(env["GPUCLUSTER_BOOT_LOG"]), exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        handlers=[logging.StreamHandler(), logging.FileHandler(env["GPUCLUSTER_BOOT_LOG"])])
    try:
        settings = fetch(env, boto3_module())
    except Exception:
        log.exception("fetching the settings and bundle failed")
        return 1
    bootstrap = env["GPUCLUSTER_BOOTSTRAP"]
    if applied_file is None:
        return subprocess.call([sys.executable, bootstrap, env["GPUCLUSTER_ROLE"]])
    if applied(applied_file, settings):
        return 0
    log.info("the stack changed: applying it in place")
    return subprocess.call([sys.executable, bootstrap, env["GPUCLUSTER_ROLE"], "--update"])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
