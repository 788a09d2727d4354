"""The stack's people (settings.ClusterSettings.people) as accounts on this node: the same name, uid and personal group
(gid = uid) on the head and on every compute node, made with explicit ids before slurmd or a session can start.

- A person: a group of their name, gid = uid, and a user of that uid, shell /bin/bash, home /home/<name> (the shared
  file system: the bootstrap makes it), no password (useradd leaves the shadow entry locked: "!"), the GECOS field
  MARK, by which this program knows the accounts it made.
- A name or id the node already gives another account is an error that stops the boot, naming both: never a silent
  renumbering, which would hand one person's files on /fsx to another.
- A person the stack no longer lists is locked, not deleted (`usermod --lock --expiredate 1 --shell nologin`): any
  password locked (they never have one), the account expired (PAM's account check refuses it to su, login and sshd),
  no login shell. Their IAM principals lose the session policy with the stack (the Pulumi side). The passwd entry
  stays: their files on /fsx keep a name (ls, sacct), and their uid is never given to someone else by mistake (that
  person's account is refused here, naming the locked one). Listed again: the expiry cleared and the shell back.
- Admins (`admin: true`) get sudo through SUDOERS alone, checked with `visudo -cf` before it is renamed into place;
  no person keeps a privileged group (lockdown.PRIVILEGED_GROUPS).
- With no people (a stack without `users:`) the image's shared login user is left exactly as it is; with people it is
  locked like a removed person (the shared login stays only without `users:`).

Compute nodes keep up with a changed stack through the shared file system: the head publishes the people, signed with
the munge key every node has (HMAC-SHA256), in SHARED_PEOPLE_FILE at each boot and update, before it changes Slurm's
associations; every compute node's Prolog applies the file before each job (health.py), so a person's job never
starts on a node that lacks their account. The signature keeps whoever may write into /fsx (S3 imports bring owners
and modes) from making accounts or admins there. Standard library only; idempotent.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import logging
import os
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from gpucluster.contract.lockdown import PRIVILEGED_GROUPS
from gpucluster.contract.people import ACCOUNT_MARK
from gpucluster.contract.settings import LOGIN_USER, SHARED_PEOPLE_FILE, PersonSettings, load_people

MARK = ACCOUNT_MARK  # the GECOS field of every account made here
SHELL = "/bin/bash"
NOLOGIN = "/usr/sbin/nologin"
SUDOERS = "etc/sudoers.d/gpucluster-admins"  # under the node's root
MUNGE_KEY = Path("/etc/munge/munge.key")

log = logging.getLogger("gpucluster-accounts")

SETTLE_LOCK = "/run/gpucluster-accounts.lock"  # held while a node's accounts are settled
Runner = Callable[..., object]  # runs one command (argv), raising on failure


def _run(*args: str) -> None:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {(done.stderr or done.stdout).strip()}")


def _table(path: Path) -> list[list[str]]:
    """/etc/passwd or /etc/group as lists of fields."""
    return [line.split(":") for line in path.read_text().splitlines() if line and not line.startswith("#")]


class AccountError(RuntimeError):
    """A person's name or id is another account's on this node."""


class UnsignedFile(ValueError):
    """A people file on the shared file system that the head did not write."""


def clashes(people: tuple[PersonSettings, ...], passwd: list[list[str]], group: list[list[str]]) -> list[str]:
    """Every name or id of a person that this node gives to another account or group, naming both."""
    problems = []
    for person in people:
        for kind, table in (("account", passwd), ("group", group)):
            for fields in table:
                name, number = fields[0], int(fields[2])
                if name == person.name and number != person.uid:
                    problems.append(f"{person.name} (uid {person.uid}): the node's {kind} {name} exists with id "
                                    f"{number}")
                elif number == person.uid and name != person.name:
                    problems.append(f"{person.name} (uid {person.uid}): id {number} is the node's {kind} {name}'s")
    return problems


def settle(people: tuple[PersonSettings, ...], root: Path = Path("/"), run: Runner = _run) -> list[str]:
    """This node's accounts as the stack lists them; returns what changed, for the log. Raises AccountError, naming
    every clash, before it changes anything. One at a time on a node: Slurm runs the Prologs of jobs that start
    together side by side (no PrologFlags=Serial), and a second groupadd of the same person would fail."""
    lock = root / SETTLE_LOCK.lstrip("/")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        return _settle(people, root, run)


def _settle(people: tuple[PersonSettings, ...], root: Path, run: Runner) -> list[str]:
    etc = root / "etc"
    prefix = [] if root == Path("/") else ["--prefix", str(root)]
    passwd, group = _table(etc / "passwd"), _table(etc / "group")
    if problems := clashes(people, passwd, group):
        raise AccountError("; ".join(problems))
    accounts = {fields[0]: fields for fields in passwd}
    groups = {fields[0] for fields in group}
    changed = []
    for person in people:
        if person.name not in groups:
            run("groupadd", *prefix, "--gid", str(person.uid), person.name)
        account = accounts.get(person.name)
        if account is None:
            run("useradd", *prefix, "--uid", str(person.uid), "--gid", str(person.uid), "--no-user-group",
                "--no-create-home", "--home-dir", f"/home/{person.name}", "--shell", SHELL, "--comment", MARK,
                person.name)
            changed.append(f"made {person.name} (uid {person.uid})")
        elif account[6] == NOLOGIN:  # locked when the stack dropped them; listed again
            # No --unlock: a person never has a password ("!" from useradd), locked or not.
            run("usermod", *prefix, "--expiredate", "", "--shell", SHELL, person.name)
            changed.append(f"unlocked {person.name}")
    listed = {person.name for person in people}
    gone = [name for name, fields in accounts.items() if fields[4] == MARK and name not in listed]
    gone += [LOGIN_USER] if people and LOGIN_USER in accounts else []
    for name in gone:
        if accounts[name][6] != NOLOGIN:
            run("usermod", *prefix, "--lock", "--expiredate", "1", "--shell", NOLOGIN, name)
            changed.append(f"locked {name}")
    for person in people:
        privileged = [fields[0] for fields in group
                      if fields[0] in PRIVILEGED_GROUPS and person.name in fields[3].split(",")]
        if privileged:
            run("usermod", *prefix, "--remove", "--groups", ",".join(privileged), person.name)
            changed.append(f"took {person.name} out of {', '.join(privileged)}")
    if sudo_rules(people, root, run):
        changed.append("admins' sudo rules rewritten")
    return changed


def sudoers(people: tuple[PersonSettings, ...]) -> str:
    """The admins' rules ("" when there is none). NOPASSWD: people have no password; they come in through Session
    Manager as themselves."""
    admins = [person.name for person in people if person.admin]
    if not admins:
        return ""
    return ("# gpucluster: the stack's admins (users: admin: true). Rewritten at every boot and update.\n"
            + "".join(f"{name} ALL=(ALL) NOPASSWD:ALL\n" for name in admins))


def sudo_rules(people: tuple[PersonSettings, ...], root: Path = Path("/"), run: Runner = _run) -> bool:
    """SUDOERS as `sudoers` says, 0440, checked by visudo (where sudo is installed) before it takes effect; removed
    when there is no admin. Returns whether it changed."""
    path = root / SUDOERS
    text = sudoers(people)
    if not text:
        if path.exists():
            path.unlink()
            return True
        return False
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    new = path.with_name(f".{path.name}.new")  # sudo skips names with a dot: never read half-written
    new.unlink(missing_ok=True)
    with os.fdopen(os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o440), "w") as out:
        out.write(text)
    if Path("/usr/sbin/visudo").exists():
        run("/usr/sbin/visudo", "-cf", str(new))
    os.replace(new, path)
    return True


# --- the people on the shared file system, for the compute nodes' Prolog ---------------------------------------------

def _signature(body: bytes, key: bytes) -> str:
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def publish(people: tuple[PersonSettings, ...], path: Path = Path(SHARED_PEOPLE_FILE),
            key: Path = MUNGE_KEY) -> None:
    """The head's: the people, signed, into `path` (its directory root's own), written by rename."""
    body = json.dumps([asdict(person) for person in people], sort_keys=True)
    new = path.with_name(f".{path.name}.new")
    new.write_text(json.dumps({"people": body, "hmac_sha256": _signature(body.encode(), key.read_bytes())}) + "\n")
    os.chmod(new, 0o644)
    os.replace(new, path)


def published(path: Path = Path(SHARED_PEOPLE_FILE), key: Path = MUNGE_KEY) -> tuple[PersonSettings, ...] | None:
    """The people the head published; None when there is no file yet. Raises UnsignedFile when its signature does
    not hold (someone else wrote it)."""
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:  # not JSON, not UTF-8: nothing the head wrote
        raise UnsignedFile(f"{path} is not the head's: {exc}") from None
    body = document.get("people", "") if isinstance(document, dict) else ""
    expected = _signature(str(body).encode(), key.read_bytes())
    if not hmac.compare_digest(expected, str(document.get("hmac_sha256", "")) if body else ""):
        raise UnsignedFile(f"{path} is not signed with this cluster's munge key: ignored")
    return load_people(json.loads(body))
