"""The stress run's fault primitives, each one system call or a few: damage a chunk file,
put a file no chunk could be in a chunk file's place, put a link in the namespace
directory's place, mount and fill a small tmpfs, find and signal a tier worker of the run's
own engine.

Who calls: the chaos runner (``shmtier/stress/chaos.py``) on the run's scheduler thread,
between manager calls. ``fill`` and ``corrupt`` write files (bounded by the tmpfs size or
one chunk file; ``plant_big``'s file is sparse: it takes no space); nothing here waits on
another process.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess

#: How a chunk file is damaged: XOR bytes of its payload, cut it in half, overwrite the
#: start of its header (magic, lengths) with random bytes.
CORRUPTIONS = ("flip", "truncate", "header")


def chunk_files(root: str) -> list[str]:
    """Paths of the published ``*.kv`` chunk files under ``root``."""
    return [os.path.join(where, n) for where, _, names in os.walk(root)
            for n in names if n.endswith(".kv")]


def corrupt(path: str, how: str, rng) -> list | None:
    """Damage the chunk file at ``path`` in place (``how`` in CORRUPTIONS); returns the
    file's identity after the damage (``identity``), or None when the file is gone (a
    delete or an eviction won the race)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        size = st.st_size
        if size < 128:
            return None
        if how == "flip":  # the payload: past any header (key + tag + fields < 128 bytes)
            at = int(rng.integers(128, size - 8))
            os.pwrite(fd, bytes(b ^ 0xFF for b in os.pread(fd, 8, at)), at)
        elif how == "truncate":
            os.ftruncate(fd, size // 2)
        elif how == "header":
            os.pwrite(fd, rng.integers(0, 256, 16, dtype="uint8").tobytes(), 0)
        else:
            raise ValueError(f"corruption {how!r}: expected one of {CORRUPTIONS}")
        return identity(os.fstat(fd))
    finally:
        os.close(fd)


#: The size of the file ``plant_big`` puts at a chunk's name: more than any chunk, and more
#: than a result's 32-bit per-key figure carries (issue 28: such a file failed the tier).
BIG_FILE_BYTES = 5 << 30


def plant_big(path: str) -> list | None:
    """Replace the chunk file at ``path`` by a sparse file of ``BIG_FILE_BYTES`` (made
    beside it and renamed over it: a reader sees the chunk or the big file); returns the
    big file's identity, or None when ``path`` is gone (an eviction won the race)."""
    if not os.path.isfile(path) or os.path.islink(path):
        return None
    tmp = os.path.join(os.path.dirname(path), f".stress-big.{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, BIG_FILE_BYTES)
        finally:
            os.close(fd)
        os.rename(tmp, path)
        return identity(os.lstat(path))
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return None


def link_namespace(namespace: str, aside: str) -> bool:
    """Move the namespace directory ``namespace`` to ``aside`` (same filesystem; an empty
    directory there when the namespace is absent now) and put a symbolic link to it in
    its place: what an operator's ``mv ns elsewhere && ln -s elsewhere ns`` leaves. False
    when the link could not be made (the root is gone): nothing changed then."""
    if os.path.lexists(aside):
        shutil.rmtree(aside, ignore_errors=True)
    try:
        if os.path.isdir(namespace) and not os.path.islink(namespace):
            os.rename(namespace, aside)
        else:
            os.mkdir(aside, 0o700)
        os.symlink(aside, namespace)
        return True
    except OSError:
        if os.path.isdir(aside) and not os.path.lexists(namespace):
            try:
                os.rename(aside, namespace)
            except OSError:
                pass
        return False


def _exchange(a: str, b: str) -> bool:
    """Swap the entries at ``a`` and ``b`` in one step (``renameat2`` RENAME_EXCHANGE,
    through libc); False where the call or the filesystem does not have it."""
    try:
        import ctypes

        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def unlink_namespace(namespace: str, aside: str) -> bool:
    """Remove the link at ``namespace`` and move the directory ``aside`` back in its place
    (the operator undoing ``link_namespace``); when something else is there now or the root
    is gone, ``aside`` is removed instead. True when the directory went back. The link and
    the directory are swapped in one step where the kernel can (then ``aside`` is the link,
    removed): removing the link first would leave a moment with no namespace, in which a
    tier worker's store makes one anew and the directory cannot go back."""
    if os.path.islink(namespace) and os.path.isdir(aside) and not os.path.islink(aside):
        if _exchange(aside, namespace):
            os.unlink(aside)
            return True
    if os.path.islink(namespace):
        os.unlink(namespace)
    if not os.path.lexists(namespace) and os.path.isdir(os.path.dirname(namespace)):
        try:
            os.rename(aside, namespace)
            return True
        except OSError:
            pass
    shutil.rmtree(aside, ignore_errors=True)
    return False


def identity(st: os.stat_result) -> list:
    """A file's inode and change time: a file removed and made again may get the same
    inode number, not the same change time."""
    return [st.st_ino, st.st_ctime_ns]


def still_there(path: str, ident: list) -> bool:
    """Whether ``path`` still names the file damaged (nobody removed or replaced it)."""
    try:
        return identity(os.lstat(path)) == list(ident)
    except OSError:
        return False


def mount_tmpfs(where: str, size_bytes: int) -> str | None:
    """Mount a tmpfs of ``size_bytes`` on directory ``where``; None when done, else why
    not (not root, no mount(8), not permitted here)."""
    try:
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700",
                            "shmtier-stress", where], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"mount -t tmpfs failed: {e}"
    if p.returncode != 0:
        return f"mount -t tmpfs failed (exit {p.returncode}): {p.stderr.strip() or p.stdout.strip()}"
    return None


def unmount(where: str) -> str | None:
    """Unmount ``where`` (lazily if busy); None when done, else why not."""
    for args in (["umount", where], ["umount", "-l", where]):
        try:
            p = subprocess.run(args, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"umount failed: {e}"
        if p.returncode == 0:
            return None
    return f"umount {where} failed: {p.stderr.strip()}"


def fill(path: str) -> int:
    """Write a filler file at ``path`` until its filesystem answers ENOSPC; returns its
    bytes. Other errors propagate (the filler is removed)."""
    block = bytes(1 << 20)
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for size in (1 << 20, 4096):
            view = memoryview(block)[:size]
            while True:
                try:
                    n = os.write(fd, view)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
                written += n
                if n < size:
                    break
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return written


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
