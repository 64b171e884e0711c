"""The safe-file layer against the attacks it exists for: each test plants the
attack first and asserts it is in place, then that nothing followed it."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from gpuwarden import safefs
from gpuwarden.safefs import TooLargeError, UnsafePathError


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A file outside the hostile tree that must never be read or changed."""
    p = tmp_path / "secret.txt"
    p.write_text("do not leak")
    return p


def test_open_file_refuses_a_symlink_to_a_file_outside(tmp_path: Path, secret: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "message.json").symlink_to(secret)
    assert (tree / "message.json").is_symlink()
    with pytest.raises(UnsafePathError, match="symlink"):
        safefs.read_bytes(tree / "message.json", 1000)
    with pytest.raises(UnsafePathError, match="symlink"):
        safefs.read_bytes("message.json", 1000, under=tree)


def test_a_link_in_a_middle_component_is_not_followed(tmp_path: Path, secret: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "report").symlink_to(tmp_path)
    assert (tree / "report" / "secret.txt").read_text() == "do not leak"  # the attack works
    with pytest.raises(UnsafePathError, match="symlink"):
        safefs.read_bytes("report/secret.txt", 1000, under=tree)


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "message.json"
    os.mkfifo(fifo)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    done = threading.Event()
    errors: list[BaseException] = []

    def read() -> None:
        try:
            safefs.read_bytes(fifo, 1000)
        except BaseException as exc:
            errors.append(exc)
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(5), "reading a FIFO blocked"
    assert isinstance(errors[0], UnsafePathError)
    assert "fifo" in str(errors[0])


def test_a_socket_and_a_device_are_refused(tmp_path: Path) -> None:
    sock_path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock_path))
        assert stat.S_ISSOCK(os.lstat(sock_path).st_mode)
        with pytest.raises(UnsafePathError):
            safefs.read_bytes(sock_path, 10)
    (tmp_path / "zero").symlink_to("/dev/zero")
    with pytest.raises(UnsafePathError, match="symlink"):
        safefs.read_bytes(tmp_path / "zero", 10)
    with pytest.raises(UnsafePathError, match="character device"):
        safefs.read_bytes("/dev/zero", 10)


def test_a_large_file_is_read_only_up_to_its_limit(tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.write_bytes(b"x" * 5000)
    assert safefs.read_bytes(big, 5000) == b"x" * 5000
    with pytest.raises(TooLargeError, match="larger than 4999"):
        safefs.read_bytes(big, 4999)


def test_dotdot_and_absolute_paths_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsafePathError, match=r"'\.' or '\.\.'"):
        safefs.read_bytes("../x", 10, under=tmp_path)
    with pytest.raises(UnsafePathError, match="absolute"):
        safefs.read_bytes("/etc/passwd", 10, under=tmp_path)


def test_walk_lists_files_and_refuses_everything_else(tmp_path: Path, secret: Path) -> None:
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "a.txt").write_text("aaa")
    (out / "sub" / "b.bin").write_bytes(b"bb")
    (out / "leak").symlink_to(secret)
    (out / "dirlink").symlink_to(tmp_path)
    os.mkfifo(out / "pipe")
    listing = safefs.walk(out)
    assert [e.path for e in listing.files] == ["a.txt", "sub/b.bin"]
    assert listing.total_bytes == 5
    assert listing.dirs == ["sub"]
    refused = {e.path: e.kind for e in listing.refused}
    assert refused == {"leak": "symlink", "dirlink": "symlink", "pipe": "fifo"}
    assert all(e.why for e in listing.refused)
    assert listing.truncated is None


def test_walk_of_a_missing_folder_is_empty(tmp_path: Path) -> None:
    assert safefs.walk(tmp_path / "nope") == safefs.Listing()


def _nest(top: Path, depth: int) -> Path:
    """``depth`` nested folders below ``top``, made with descriptors (paths that
    deep pass PATH_MAX)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        with open(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "w") as f:
            f.write("deep")
    finally:
        os.close(fd)
    return top


def test_walk_and_remove_a_tree_deeper_than_the_recursion_limit(tmp_path: Path) -> None:
    top = tmp_path / "out"
    top.mkdir()
    _nest(top, 1100)
    # the attack: pathlib and shutil recurse and fail on it
    with pytest.raises(RecursionError):
        list(top.rglob("*"))
    listing = safefs.walk(top, max_depth=64)
    assert len(listing.dirs) == 64
    assert listing.refused and "64 levels" in listing.refused[0].why
    safefs.remove_tree(top)
    assert not top.exists()


def test_walk_stops_after_max_entries(tmp_path: Path) -> None:
    for i in range(20):
        (tmp_path / f"f{i:02}").write_text("x")
    listing = safefs.walk(tmp_path, max_entries=5)
    assert len(listing.files) == 5
    assert listing.truncated == "stopped after 5 entries"


def test_non_utf8_names_are_refused_and_shown_readably(tmp_path: Path) -> None:
    raw = os.path.join(os.fsencode(tmp_path), b"bad\xff.txt")
    with open(raw, "wb") as f:
        f.write(b"x")
    listing = safefs.walk(tmp_path)
    assert listing.files == []
    assert listing.refused[0].path == "bad\\xff.txt"
    assert "UTF-8" in listing.refused[0].why


def test_make_dir_fails_if_anything_is_there(tmp_path: Path, secret: Path) -> None:
    slot = tmp_path / "slot"
    slot.symlink_to(tmp_path)
    assert slot.is_symlink()
    with pytest.raises(FileExistsError):
        safefs.make_dir(slot)
    assert slot.is_symlink()  # untouched, and nothing was created through it
    fresh = tmp_path / "fresh"
    old = os.umask(0o777)
    try:
        safefs.make_dir(fresh, mode=0o750)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(fresh).st_mode) == 0o750


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_make_dir_chowns_only_what_it_created(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh"
    safefs.make_dir(fresh, owner=(65534, 65534))
    st = os.lstat(fresh)
    assert (st.st_uid, st.st_gid) == (65534, 65534)
    assert os.lstat(tmp_path).st_uid == 0


def test_remove_tree_removes_a_link_not_its_target(tmp_path: Path, secret: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("keep")
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "link").symlink_to(victim)
    (tree / "file").symlink_to(secret)
    safefs.remove_tree(tree)
    assert not tree.exists()
    assert (victim / "keep.txt").read_text() == "keep"
    assert secret.read_text() == "do not leak"
    top_link = tmp_path / "toplink"
    top_link.symlink_to(victim)
    safefs.remove_tree(top_link)
    assert not top_link.is_symlink()
    assert (victim / "keep.txt").exists()
    safefs.remove_tree(tmp_path / "missing")  # nothing there: fine


def test_remove_tree_fails_loudly(tmp_path: Path) -> None:
    """An entry that cannot be removed raises, instead of rmtree's quiet
    ignore_errors. As root the entry is made immutable (chattr +i); otherwise its
    folder is made read-only."""
    tree = tmp_path / "tree"
    (tree / "ro").mkdir(parents=True)
    stuck = tree / "ro" / "f"
    stuck.write_text("x")
    if os.geteuid() == 0:
        if shutil.which("chattr") is None:
            pytest.skip("as root, needs chattr to make a file that cannot be removed")
        made = subprocess.run(["chattr", "+i", str(stuck)], capture_output=True, check=False)
        if made.returncode != 0:
            pytest.skip(f"chattr +i is not supported here: {made.stderr.decode().strip()}")
        undo = ["chattr", "-i", str(stuck)]
    else:
        (tree / "ro").chmod(0o500)
        undo = ["chmod", "700", str(tree / "ro")]
    try:
        with pytest.raises(PermissionError):
            stuck.unlink()  # the fault is in place
        with pytest.raises(PermissionError):
            safefs.remove_tree(tree)
        assert stuck.exists()
    finally:
        subprocess.run(undo, check=True)


def test_copy_tree_copies_files_and_leaves_links_behind(tmp_path: Path, secret: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "a").write_text("A")
    (src / "d" / "b").write_text("BB")
    (src / "d" / "leak").symlink_to(secret)
    os.mkfifo(src / "pipe")
    dst = tmp_path / "dst"
    listing = safefs.copy_tree(src, dst)
    assert (dst / "a").read_text() == "A"
    assert (dst / "d" / "b").read_text() == "BB"
    assert not os.path.lexists(dst / "d" / "leak")
    assert not os.path.lexists(dst / "pipe")
    assert {e.path for e in listing.refused} == {"d/leak", "pipe"}
    assert listing.total_bytes == 3


def test_copy_tree_into_an_existing_destination_fails(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "dst").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileExistsError):
        safefs.copy_tree(tmp_path / "src", tmp_path / "dst")
    assert not (tmp_path / "elsewhere").exists()


def test_copy_tree_stops_past_max_bytes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"x" * 100)
    (src / "b").write_bytes(b"x" * 100)
    with pytest.raises(TooLargeError):
        safefs.copy_tree(src, tmp_path / "dst", max_bytes=150)


def test_move_entries_moves_links_as_links(tmp_path: Path, secret: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("f")
    (src / "l").symlink_to(secret)
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "f").write_text("already here")
    with safefs.opened_dir(src) as fd:
        left = safefs.move_entries(fd, dst)
    assert left == ["f"]
    assert (dst / "l").is_symlink()
    assert (dst / "f").read_text() == "already here"
    assert secret.read_text() == "do not leak"


def test_a_link_swapped_in_while_walking_is_not_followed(tmp_path: Path, secret: Path) -> None:
    """A writer that keeps replacing a folder with a link to outside: the walk
    never lists anything outside the tree."""
    top = tmp_path / "out"
    top.mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "stolen").write_text("x")
    stop = threading.Event()
    swaps = 0

    def swap() -> None:
        nonlocal swaps
        while not stop.is_set():
            d = top / "d"
            try:
                d.mkdir()
                (d / "mine").write_text("m")
                (d / "mine").unlink()
                d.rmdir()
                d.symlink_to(tmp_path / "outside")
                d.unlink()
                swaps += 1
            except OSError:
                pass

    t = threading.Thread(target=swap, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            listing = safefs.walk(top)
            assert all("stolen" not in e.path for e in listing.files)
    finally:
        stop.set()
        t.join()
    assert swaps > 0


def test_make_dirs_makes_missing_folders_and_follows_no_link(tmp_path: Path, secret: Path) -> None:
    top = tmp_path / "top"
    top.mkdir()
    (top / "a").mkdir(mode=0o755)
    fd = safefs.make_dirs("a/b/c", under=top, mode=0o750)
    try:
        assert os.path.samestat(os.fstat(fd), os.stat(top / "a" / "b" / "c"))
    finally:
        os.close(fd)
    assert stat.S_IMODE((top / "a" / "b").stat().st_mode) == 0o750  # made here
    assert stat.S_IMODE((top / "a").stat().st_mode) == 0o755  # already there: left
    # a link to a folder outside, in the middle or at the end: refused, nothing made
    (top / "link").symlink_to(secret.parent)
    assert (top / "link").is_symlink() and secret.parent.is_dir()
    before = sorted(p.name for p in secret.parent.iterdir())
    for rel in ("link", "link/x", "a/../link/x"):
        with pytest.raises(UnsafePathError):
            os.close(safefs.make_dirs(rel, under=top))
    assert sorted(p.name for p in secret.parent.iterdir()) == before
    # a file on the way: refused, saying it is a file
    (top / "f.txt").write_text("x")
    with pytest.raises(UnsafePathError, match="is a file, not a folder"):
        safefs.make_dirs("f.txt/b", under=top)
    assert (top / "f.txt").read_text() == "x"
    # an empty path opens the top itself
    fd = safefs.make_dirs("", under=top)
    try:
        assert os.path.samestat(os.fstat(fd), os.stat(top))
    finally:
        os.close(fd)


def test_open_regular_never_opens_what_is_not_a_regular_file(
    tmp_path: Path, secret: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FIFO, a device, a socket, a folder or a link is refused after an O_PATH
    open (which opens nothing); only a regular file is opened for reading."""
    tree = tmp_path / "tree"
    tree.mkdir()
    os.mkfifo(tree / "fifo")
    os.mknod(tree / "zero", stat.S_IFCHR | 0o600, os.makedev(1, 5))
    (tree / "link").symlink_to(secret)
    (tree / "dir").mkdir()
    (tree / "ok").write_text("fine")
    assert stat.S_ISFIFO(os.lstat(tree / "fifo").st_mode)
    assert stat.S_ISCHR(os.lstat(tree / "zero").st_mode)
    opened: list[tuple[str, int]] = []
    real_open = os.open

    def spy(path: object, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        opened.append((os.fsdecode(path), flags))  # type: ignore[arg-type]
        return real_open(path, flags, mode, dir_fd=dir_fd)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", spy)
    for name, kind in [
        ("fifo", "fifo"),
        ("zero", "character device"),
        ("link", "symlink"),
        ("dir", "folder"),
    ]:
        with pytest.raises(UnsafePathError, match=f"is a {kind}, not a regular file"):
            safefs.open_file(tree / name)
        with pytest.raises(UnsafePathError, match=f"is a {kind}, not a regular file"):
            safefs.open_file(name, under=tree)
    fd = safefs.open_file("ok", under=tree)
    try:
        assert os.read(fd, 10) == b"fine"
    finally:
        os.close(fd)
    monkeypatch.undo()
    for name in ("fifo", "zero", "link", "dir"):
        named = [flags for p, flags in opened if p.rpartition("/")[2] == name]
        assert named and all(flags & os.O_PATH for flags in named), (name, opened)


# -- folders by descriptor (appended with make_dir_at, open_dir_at, copy_into) ----


def test_make_dir_at_creates_fresh_below_a_held_folder_even_if_its_name_moves(
    tmp_path: Path,
) -> None:
    slot = tmp_path / "slot"
    slot.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    with safefs.opened_dir(slot) as fd:
        # the folder's name now leads elsewhere: a link where it was
        slot.rename(tmp_path / "moved")
        slot.symlink_to(outside)
        assert slot.is_symlink() and slot.resolve() == outside
        sub = safefs.make_dir_at(fd, "out", mode=0o750)
        os.close(sub)
    assert (tmp_path / "moved" / "out").is_dir()
    assert stat.S_IMODE(os.lstat(tmp_path / "moved" / "out").st_mode) == 0o750
    assert list(outside.iterdir()) == []  # nothing went through the link


def test_make_dir_at_fails_if_anything_is_there(tmp_path: Path, secret: Path) -> None:
    (tmp_path / "out").symlink_to(secret.parent)
    assert (tmp_path / "out").is_symlink()
    with safefs.opened_dir(tmp_path) as fd:
        with pytest.raises(FileExistsError):
            safefs.make_dir_at(fd, "out")
        with pytest.raises(UnsafePathError, match="plain name"):
            safefs.make_dir_at(fd, "a/b")
    assert (tmp_path / "out").is_symlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_make_dir_at_chowns_the_new_folder_only(tmp_path: Path) -> None:
    with safefs.opened_dir(tmp_path) as fd:
        os.close(safefs.make_dir_at(fd, "slot", owner=(65534, 65534)))
    st = os.lstat(tmp_path / "slot")
    assert (st.st_uid, st.st_gid) == (65534, 65534)
    assert os.lstat(tmp_path).st_uid == 0


def test_open_dir_at_refuses_a_link_in_any_component(tmp_path: Path, secret: Path) -> None:
    (tmp_path / "slot").mkdir()
    (tmp_path / "slot" / "out").symlink_to(secret.parent)
    assert (tmp_path / "slot" / "out").is_symlink()
    with safefs.opened_dir(tmp_path) as fd:
        with pytest.raises(UnsafePathError, match="symlink"):
            safefs.open_dir_at(fd, "slot/out")
        sub = safefs.open_dir_at(fd, "slot")
        os.close(sub)


def test_copy_into_copies_into_a_held_folder_and_never_replaces(
    tmp_path: Path, secret: Path
) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "a").write_text("A")
    (src / "b").write_text("new b")
    (src / "d" / "c").write_text("C")
    (src / "leak").symlink_to(secret)
    os.mkfifo(src / "pipe")
    dst = tmp_path / "dst"
    (dst / "d").mkdir(parents=True)
    (dst / "b").write_text("old b")
    with safefs.opened_dir(dst) as fd:
        listing = safefs.copy_into(src, fd, file_mode=0o640)
    assert (dst / "a").read_text() == "A"
    assert stat.S_IMODE(os.lstat(dst / "a").st_mode) == 0o640
    assert (dst / "b").read_text() == "old b"  # never replaced
    assert (dst / "d" / "c").read_text() == "C"  # an existing folder is entered
    assert not os.path.lexists(dst / "leak") and not os.path.lexists(dst / "pipe")
    refused = {e.path: e.why for e in listing.refused}
    assert set(refused) == {"b", "leak", "pipe"}
    assert "already in the destination" in refused["b"]
    assert sorted(e.path for e in listing.files) == ["a", "d/c"]


def test_copy_into_refuses_a_link_where_a_folder_would_go(tmp_path: Path, secret: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "x").write_text("x")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "d").symlink_to(secret.parent)
    assert (dst / "d").is_symlink()
    with safefs.opened_dir(dst) as fd:
        listing = safefs.copy_into(src, fd)
    assert [e.path for e in listing.refused] == ["d"]
    assert not (secret.parent / "x").exists()
