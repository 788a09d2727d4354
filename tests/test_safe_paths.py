"""Paths root makes where a user may have been first (gpucluster/node/safe_paths.py): on a world-writable, sticky
directory as /fsx is, what a user planted (a link to a file root must not write, another owner's directory) is set
aside, never followed, and root's own directory is made anew. Run as root, as the node programs are (chown needs it)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from gpucluster.node import safe_paths

USER = 4321  # any uid but root's: chown by root takes any number


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """A directory like /fsx after the first boot: root's, world-writable, sticky."""
    if os.geteuid() != 0:
        pytest.skip("root's programs: chown needs root")
    fsx = tmp_path / "fsx"
    fsx.mkdir()
    fsx.chmod(0o1777)
    return fsx


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """What a planted link points at: must come out of every test as it went in."""
    target = tmp_path / "etc"
    target.mkdir(mode=0o700)
    (target / "shadow").write_text("root:secret\n")
    return target


def unchanged(victim: Path) -> bool:
    info = victim.stat()
    return (stat.S_IMODE(info.st_mode), info.st_uid) == (0o700, 0) and \
        [p.name for p in victim.iterdir()] == ["shadow"] and (victim / "shadow").read_text() == "root:secret\n"


def set_aside(parent: Path, name: str) -> list[Path]:
    return sorted(parent.glob(f"{name}.set-aside-*"))


def test_a_missing_directory_is_made_with_its_owner_and_mode(shared: Path) -> None:
    made = safe_paths.own_directory(shared / "home")
    info = os.lstat(made)
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == 0 and stat.S_IMODE(info.st_mode) == 0o755
    mine = safe_paths.own_directory(made / "ubuntu", USER, USER, 0o700)
    assert (mine.stat().st_uid, stat.S_IMODE(mine.stat().st_mode)) == (USER, 0o700)


def test_roots_own_directory_is_kept_with_what_is_in_it_and_its_mode_set(shared: Path) -> None:
    (shared / "enroot").mkdir(mode=0o777)
    (shared / "enroot").chmod(0o1777)  # an older image's layout
    (shared / "enroot" / "kept").write_text("x")
    safe_paths.own_directory(shared / "enroot")
    assert (shared / "enroot" / "kept").read_text() == "x" and not set_aside(shared, "enroot")
    assert stat.S_IMODE((shared / "enroot").stat().st_mode) == 0o755


@pytest.mark.parametrize("plant", ["link", "file", "another's directory"])
def test_what_a_user_planted_is_set_aside_and_never_followed(plant: str, shared: Path, victim: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    path = shared / ".gpucluster"
    if plant == "link":
        path.symlink_to(victim)
    elif plant == "file":
        path.write_text("a user's")
    else:
        path.mkdir()
    os.chown(path, USER, USER, follow_symlinks=False)
    with caplog.at_level(logging.WARNING):
        safe_paths.own_directory(path)
    assert not path.is_symlink() and path.is_dir() and path.stat().st_uid == 0 and not any(path.iterdir())
    assert unchanged(victim)
    [aside] = set_aside(shared, ".gpucluster")
    assert os.lstat(aside).st_uid == USER  # the user's, kept for them to see, renamed
    assert f"{path}" in caplog.text and str(aside) in caplog.text


def test_a_link_planted_between_the_look_and_the_mkdir_is_set_aside_too(shared: Path, victim: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path, real_mkdir, raced = shared / "examples", os.mkdir, [False]

    def racing_mkdir(where: str | os.PathLike[str], mode: int = 0o777) -> None:
        if not raced[0]:  # the user wins the first race
            raced[0] = True
            path.symlink_to(victim)
        real_mkdir(where, mode)

    monkeypatch.setattr(os, "mkdir", racing_mkdir)
    safe_paths.own_directory(path)
    assert raced[0] and not path.is_symlink() and path.stat().st_uid == 0 and unchanged(victim)
    assert len(set_aside(shared, "examples")) == 1


def test_a_tree_replaces_roots_former_copy_whole(shared: Path) -> None:
    def build(version: str):
        def make(new: Path) -> None:
            new.mkdir()
            (new / "README").write_text(version)
        return make

    safe_paths.replace_tree(build("1"), shared / "examples")
    safe_paths.replace_tree(build("2"), shared / "examples")
    assert (shared / "examples" / "README").read_text() == "2"
    assert stat.S_IMODE((shared / "examples").stat().st_mode) == 0o755
    assert sorted(p.name for p in shared.iterdir()) == ["examples"]  # no staging and nothing set aside left


def test_a_tree_never_goes_through_a_planted_link(shared: Path, victim: Path) -> None:
    (shared / "examples").symlink_to(victim)
    safe_paths.replace_tree(lambda new: new.mkdir(), shared / "examples")
    assert unchanged(victim) and not (shared / "examples").is_symlink() and (shared / "examples").is_dir()
    [aside] = set_aside(shared, "examples")
    assert aside.is_symlink()


def test_a_link_planted_between_the_two_renames_loses(shared: Path, victim: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real_rename, raced = os.rename, [False]

    def racing_rename(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
        if str(target) == str(shared / "examples") and not raced[0]:
            raced[0] = True
            (shared / "examples").symlink_to(victim)
        real_rename(source, target)

    monkeypatch.setattr(os, "rename", racing_rename)
    safe_paths.replace_tree(lambda new: new.mkdir(), shared / "examples")
    assert raced[0] and not (shared / "examples").is_symlink() and unchanged(victim)
    assert len(set_aside(shared, "examples")) == 1
