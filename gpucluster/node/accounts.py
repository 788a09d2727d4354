"""The stack's people (settings.ClusterSettings.people) as accounts on this node: the same name, uid and personal group
(gid = uid) on the head and on every compute node, made with explicit ids before slurmd or a session can start.

- A person: a group of their name, gid = uid, and a user of that uid, shell /bin/bash, home /home/<name> (the shared
  file system: the bootstrap makes it), no password (useradd leaves the shadow entry locked: "!"). The GECOS field
  MARK is a hint for people reading /etc/passwd only: what the cluster made is the root-owned list ACCOUNTS_FILE
  ("name:uid", kept after a removal), and it removes no account that list does not name (an account an admin made
  by hand, whatever its GECOS, is never touched).
- A name or id the node already gives another account, or that the list gave another person before, is an error
  that stops the boot, naming both: never a silent renumbering, which would hand one person's files on /fsx to
  another.
- A person the stack no longer lists, on the head (the only node their Session documents reach): their processes
  killed (their open Session Manager shells among them; logged), then their account deleted (`userdel --force`,
  without --remove: their home on /fsx stays). Deleted, not locked: Session Manager's agent never asks PAM
  (amazon-ssm-agent agent/session/shell/shell_unix.go and session/utility/utility_unix.go: the run-as user must exist
  for `id <name>`, then the agent runs `sh` with that uid and gid; expiry, a locked password and a nologin shell are
  never looked at). The sessions stay open at AWS until they are terminated (docs/how-to/people.md); their IAM
  principals lose the session policy with the stack (the Pulumi side): no new session. On a compute node the account
  is locked and kept (no session reaches it; a job of theirs still running there may start further steps, for which
  slurmd looks the user up). Listed again: made again with the same uid, or unlocked.
- Admins (`admin: true`) get sudo through SUDOERS alone, checked with `visudo -cf` before it is renamed into place;
  no person keeps a privileged group (lockdown.PRIVILEGED_GROUPS).
- With no people (a stack without `users:`) the image's shared login user is left exactly as it is; with people it is
  locked (`usermod --lock --expiredate 1 --shell nologin`: su, login and sshd refuse it; Session Manager would not,
  but no person's Session document runs as it and the stack's policies allow no other).

Compute nodes keep up with a changed stack through the shared file system: the head publishes the people, signed, in
SHARED_PEOPLE_FILE at each boot and update, before it changes Slurm's associations; every compute node's Prolog
applies the file before each job (health.py), so a person's job never starts on a node that lacks their account. The
signature (HMAC-SHA256 with a key derived from the munge key every node has) keeps whoever may write into /fsx (S3
imports bring owners and modes) from making accounts or admins there; the generation signed with the people keeps
them from bringing back an older signed copy (a removed person, a former admin's sudo): a node refuses a generation
below the highest it applied (GENERATION_FILE) and keeps its accounts. Standard library only; idempotent.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from gpucluster.contract.lockdown import PRIVILEGED_GROUPS
from gpucluster.contract.people import ACCOUNT_MARK
from gpucluster.contract.settings import (
    LOGIN_USER,
    PEOPLE_ACCOUNTS_FILE,
    PEOPLE_GENERATION_FILE,
    SHARED_PEOPLE_FILE,
    PersonSettings,
    load_people,
)

MARK = ACCOUNT_MARK  # the GECOS field of every account made here: a hint for readers, never a test
SHELL = "/bin/bash"
NOLOGIN = "/usr/sbin/nologin"
SUDOERS = "etc/sudoers.d/gpucluster-admins"  # under the node's root
ACCOUNTS_FILE = PEOPLE_ACCOUNTS_FILE.lstrip("/")  # under the node's root
MUNGE_KEY = Path("/etc/munge/munge.key")
GENERATION_FILE = Path(PEOPLE_GENERATION_FILE)
# The people file's own key: HMAC-SHA256 of this label under the munge key, so that the munge key itself signs
# nothing but munge's credentials and a signature made for one purpose never passes for another.
PEOPLE_KEY_LABEL = b"gpucluster-people-v1"

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


def _write_root_file(path: Path, text: str) -> None:
    """Root's own file, 0644, replaced by rename (never half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = path.with_name(f".{path.name}.new")
    new.unlink(missing_ok=True)
    with os.fdopen(os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "w") as out:
        out.write(text)
    os.replace(new, path)


class AccountError(RuntimeError):
    """A person's name or id is another account's on this node."""


class UnsignedFile(ValueError):
    """A people file on the shared file system that the head did not write."""


class OlderFile(ValueError):
    """A signed people file older than one this node applied: an old copy brought back."""


def made_accounts(root: Path = Path("/")) -> dict[str, int]:
    """The accounts the cluster made on this node, removed since or not: name -> uid."""
    path = root / ACCOUNTS_FILE
    if not path.exists():
        return {}
    return {name: int(uid) for name, uid in (line.split(":") for line in path.read_text().split())}


def clashes(people: tuple[PersonSettings, ...], passwd: list[list[str]], group: list[list[str]],
            made: dict[str, int] | None = None) -> list[str]:
    """Every name or id of a person that this node gives to another account or group, or that the cluster gave
    another person here before (a removed person's uid is not handed on: their files on /fsx are theirs), naming
    both."""
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
        for name, uid in (made or {}).items():
            if name == person.name and uid != person.uid:
                problems.append(f"{person.name} (uid {person.uid}): the cluster made {name} here with uid {uid}")
            elif uid == person.uid and name != person.name and name not in {p.name for p in people}:
                problems.append(f"{person.name} (uid {person.uid}): uid {uid} was {name}'s, whom the stack removed")
    return problems


def settle(people: tuple[PersonSettings, ...], root: Path = Path("/"), run: Runner = _run,
           sessions_here: bool = False) -> list[str]:
    """This node's accounts as the stack lists them; returns what changed, for the log. Raises AccountError, naming
    every clash, before it changes anything. A removed person: on the node people connect to (`sessions_here`, the
    head: the people's Session documents and policies name it alone) their processes are killed and their account
    deleted; on a compute node the account is locked and kept, so that a job of theirs still running there can start
    its next steps (slurmd looks its user up). One at a time on a node: Slurm runs the Prologs of jobs that start
    together side by side (no PrologFlags=Serial), and a second groupadd of the same person would fail."""
    lock = root / SETTLE_LOCK.lstrip("/")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        return _settle(people, root, run, sessions_here)


def _settle(people: tuple[PersonSettings, ...], root: Path, run: Runner, sessions_here: bool) -> list[str]:
    etc = root / "etc"
    prefix = [] if root == Path("/") else ["--prefix", str(root)]
    passwd, group = _table(etc / "passwd"), _table(etc / "group")
    made = made_accounts(root)
    if problems := clashes(people, passwd, group, made):
        raise AccountError("; ".join(problems))
    accounts = {fields[0]: fields for fields in passwd}
    groups = {fields[0] for fields in group}
    if any(person.name not in made for person in people):  # listed before it is made: never an unlisted account
        made |= {person.name: person.uid for person in people}
        _write_root_file(root / ACCOUNTS_FILE, "".join(f"{name}:{uid}\n" for name, uid in sorted(made.items())))
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
        elif account[6] == NOLOGIN:  # locked on a compute node when the stack dropped them; listed again
            # No --unlock: a person never has a password ("!" from useradd), locked or not.
            run("usermod", *prefix, "--expiredate", "", "--shell", SHELL, person.name)
            changed.append(f"unlocked {person.name}")
    listed = {person.name for person in people}
    gone = sorted(name for name in made.keys() - listed if name in accounts)
    if sessions_here:
        for name in gone:
            if ended := end_processes(made[name]):
                changed.append(f"killed {name}'s processes {', '.join(map(str, ended))}")
            # No --remove: the home on /fsx stays. --force: whatever is left of theirs does not keep the account.
            run("userdel", *prefix, "--force", name)
            if name in {fields[0] for fields in _table(etc / "group")}:  # login.defs' USERGROUPS_ENAB no: left
                run("groupdel", *prefix, name)
            changed.append(f"deleted {name} (uid {made[name]}), the home kept")
        gone = []
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


def end_processes(uid: int, proc: Path = Path("/proc")) -> list[int]:
    """SIGKILL to every process whose real or effective uid is `uid` (a removed person's shells, Session Manager's
    among them, and whatever they started), until none is left (one may fork while another is killed); returns
    their pids. Nothing to catch first: what a removed person left running is not theirs to finish. A Slurm job's
    processes are Slurm's to end (the README: a removed person's running jobs run on): the head runs no job, and
    the boot rehearsal, whose nodes share this machine's one PID space, has the compute nodes' jobs beside it."""
    ended: list[int] = []
    for _ in range(5):
        processes = _processes(proc)
        jobs = job_processes(processes)
        found = [pid for pid, (_, uids, _) in processes.items() if uid in uids[:2] and pid not in jobs]
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            ended.append(pid)
        time.sleep(0.1)  # the kernel reaps them; a second pass finds what they forked meanwhile
    return sorted(set(ended))


def _processes(proc: Path) -> dict[int, tuple[str, list[int], int]]:
    """pid -> (name, [real, effective, saved, fs uid], parent pid), from /proc/PID/status (readable for any process,
    whatever its namespace or dumpability)."""
    found = {}
    for status in proc.glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
            found[int(status.parent.name)] = (fields["Name"].strip(), [int(u) for u in fields["Uid"].split()],
                                              int(fields["PPid"]))
        except (OSError, KeyError, ValueError):  # gone meanwhile
            continue
    return found


def job_processes(processes: dict[int, tuple[str, list[int], int]]) -> set[int]:
    """Root's slurmstepd processes and all their descendants. Root's: anyone can name a program of theirs
    slurmstepd, nobody but root can run one as root."""
    found = {pid for pid, (name, uids, _) in processes.items() if name == "slurmstepd" and uids[0] == 0}
    for pid in processes:
        chain = [pid]
        while chain[-1] in processes and chain[-1] not in found and len(chain) < 4096:
            chain.append(processes[chain[-1]][2])
        if chain[-1] in found:
            found.update(chain)
    return found


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

def people_key(munge_key: bytes) -> bytes:
    return hmac.new(munge_key, PEOPLE_KEY_LABEL, hashlib.sha256).digest()


def _signature(body: bytes, key: bytes) -> str:
    return hmac.new(people_key(key), body, hashlib.sha256).hexdigest()


def read_generation(path: Path = GENERATION_FILE) -> int:
    return int(path.read_text()) if path.exists() else 0


def record_generation(generation: int, path: Path = GENERATION_FILE) -> None:
    """Raise the generation this node holds to `generation` (never lowers it)."""
    if generation > read_generation(path):
        _write_root_file(path, f"{generation}\n")


def clock_generation() -> int:
    """The generation of a file written now: microseconds since the epoch."""
    return time.time_ns() // 1000


def publish(people: tuple[PersonSettings, ...], path: Path = Path(SHARED_PEOPLE_FILE), key: Path = MUNGE_KEY,
            counter: Path = GENERATION_FILE) -> int:
    """The head's: the people and a generation, signed, into `path` (its directory root's own), written by rename;
    returns the generation. The generation is the head's clock in microseconds, and at least one more than the
    last one the head published (`counter`, on its state volume): it grows across `pulumi up`s, head reboots and a
    replaced head (a new root volume keeps the state volume; the clock, kept by Amazon Time Sync, covers a new state
    volume too), even when the clock steps back on a running head."""
    generation = max(clock_generation(), read_generation(counter) + 1)
    record_generation(generation, counter)  # first: a crash in between never publishes one generation twice
    body = json.dumps({"generation": generation, "people": [asdict(person) for person in people]}, sort_keys=True)
    new = path.with_name(f".{path.name}.new")
    new.write_text(json.dumps({"signed": body, "hmac_sha256": _signature(body.encode(), key.read_bytes())}) + "\n")
    os.chmod(new, 0o644)
    os.replace(new, path)
    return generation


def published(path: Path = Path(SHARED_PEOPLE_FILE),
              key: Path = MUNGE_KEY) -> tuple[int, tuple[PersonSettings, ...]] | None:
    """The generation and people the head published; None when there is no file yet. Raises UnsignedFile when its
    signature does not hold (someone else wrote it)."""
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:  # not JSON, not UTF-8: nothing the head wrote
        raise UnsignedFile(f"{path} is not the head's: {exc}") from None
    body = document.get("signed", "") if isinstance(document, dict) else ""
    expected = _signature(str(body).encode(), key.read_bytes())
    if not hmac.compare_digest(expected, str(document.get("hmac_sha256", "")) if body else ""):
        raise UnsignedFile(f"{path} is not signed with this cluster's key (derived from the munge key): ignored")
    signed = json.loads(body)
    return int(signed["generation"]), load_people(signed["people"])


def apply_published(path: Path = Path(SHARED_PEOPLE_FILE), key: Path = MUNGE_KEY, applied: Path = GENERATION_FILE,
                    root: Path = Path("/"), run: Runner = _run) -> list[str]:
    """A compute node's Prolog: the published people settled here, unless the file's generation is below the highest
    this node applied (OlderFile: the node keeps its accounts). Returns what changed."""
    found = published(path, key)
    if found is None:
        return []
    generation, people = found
    if generation < (highest := read_generation(applied)):
        raise OlderFile(f"{path} has generation {generation}, older than this node's {highest} (its boot's settings "
                        "or a file applied since): not applied, the node keeps its accounts (a copy brought back "
                        "into /fsx, such as by an S3 import, is refused so)")
    changed = settle(people, root, run)
    record_generation(generation, applied)
    return changed
