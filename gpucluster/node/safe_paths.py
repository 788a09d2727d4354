"""Paths root makes where a user could have made something first: on /fsx (world-writable, and it outlives the head
node), under the instance store, in the per-user directories of the container runtime.

Root never writes through what it did not make: every entry is looked at with lstat (no link followed), one that is
not what root would have made (a symlink, a file, a directory of another owner) is set aside by a rename in the same
directory (a rename moves the entry itself, never what a link points to) and logged, and the directory is then made
anew by mkdir, which fails rather than follow anything that appeared meanwhile. Standard library only.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("gpucluster-paths")

ATTEMPTS = 5  # a user racing root's rename and mkdir on a world-writable parent loses the race this often, then we stop


def set_aside(path: Path, why: str, named_after: Path | None = None) -> Path:
    """Rename `path` (whatever it is) to a new name `<name>.set-aside-<time>[-n]` beside `named_after` (default:
    itself), and log it."""
    named_after = named_after or path
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for n in range(100):
        aside = named_after.with_name(f"{named_after.name}.set-aside-{stamp}" + (f"-{n}" if n else ""))
        if not os.path.lexists(aside):
            os.rename(path, aside)
            log.warning("%s %s: set aside as %s", named_after, why, aside)
            return aside
    raise RuntimeError(f"{named_after}: no free name to set it aside")


def foreign(path: Path, uid: int | None) -> str:
    """Why `path` is not a real directory owned by `uid` (None: by anyone) ("" when it is, or when nothing is
    there)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return ""
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if uid is not None and info.st_uid != uid:
        return f"is owned by uid {info.st_uid}, not {uid}"
    return ""


def own_directory(path: Path, uid: int = 0, gid: int = 0, mode: int = 0o755) -> Path:
    """`path` a real directory owned by uid:gid with `mode`: kept if it already is one, else what is there is set
    aside and the directory made anew by root (mkdir never follows a link and fails on anything that appeared
    meanwhile; the owner and mode are set through a descriptor opened without following a link)."""
    for _ in range(ATTEMPTS):
        if why := foreign(path, uid):
            set_aside(path, why)
        try:
            os.mkdir(path, 0o700)  # nobody else's until it is right
        except FileExistsError:
            pass
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as exc:  # a link or a file appeared between the mkdir and the open
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                continue
            raise
        try:
            if os.fstat(fd).st_uid not in (0, uid):  # another user's, made between the look and the mkdir
                continue
            os.fchown(fd, uid, gid)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        return path
    raise RuntimeError(f"{path}: something else appeared there {ATTEMPTS} times while root made it")


def replace_tree(build: Callable[[Path], Any], target: Path, mode: int = 0o755) -> None:
    """`target` made anew by `build` in a directory only root can enter beside it, then renamed into place. What was
    there is moved into that directory first (a rename: no link followed) and removed with it if it was root's own
    former copy, else set aside beside `target` and logged. A user who makes `target` between the two renames makes
    the second fail: then again."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))  # 0700, root's, made O_EXCL
    try:
        fresh = staging / "new"
        build(fresh)
        os.chmod(fresh, mode)
        for attempt in range(ATTEMPTS):
            old = staging / f"old-{attempt}"
            try:
                os.rename(target, old)
            except FileNotFoundError:
                pass
            else:
                if why := foreign(old, 0):
                    set_aside(old, why, named_after=target)
            try:
                os.rename(fresh, target)
                return
            except OSError as exc:  # something appeared at target meanwhile
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                    raise
        raise RuntimeError(f"{target}: something else appeared there {ATTEMPTS} times while root replaced it")
    finally:
        shutil.rmtree(staging)  # root's former copies and nothing else (fd-based: no link in it is followed)
