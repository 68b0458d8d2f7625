"""Publishing files and folders in one rename: a writer killed at any moment leaves either the old file, the new
one, or a hidden temporary that the next writer removes, never a file that looks complete. A write that
fails (a full disk among others) removes its temporary at once."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

DISK_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
# How libraries that keep no errno word the same errors: safetensors ("... No space left on device (os error 28)"),
# torch's legacy writer ("write(): fd 3 failed with No space left on device")
DISK_FULL_WORDS = {
    errno.ENOSPC: ("no space left on device", "(os error 28)"),
    errno.EDQUOT: ("disk quota exceeded", "(os error 122)"),
}


class DiskFullError(OSError):
    """A write that found its filesystem full (ENOSPC) or its quota spent (EDQUOT), as one line naming the file and
    the space left there. `errno` and `filename` are set as on any OSError; the original error is its __cause__."""

    def __str__(self) -> str:
        return self.strerror


def write_atomically(path: str | Path, write: Callable[[Path], None]) -> None:
    """Calls write(temporary) on a hidden file beside `path`, then renames it onto `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by a writer that was killed
        stale.unlink(missing_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(temporary)
        os.replace(temporary, path)
    except Exception as error:
        temporary.unlink(missing_ok=True)  # before the free space is measured
        raise_if_disk_full(error, path)
        raise
    finally:
        temporary.unlink(missing_ok=True)


def write_folder_atomically(folder: str | Path, write: Callable[[Path], None]) -> None:
    """Calls write(temporary) on a hidden folder beside `folder`, then replaces `folder` with it. A write that fails
    removes its temporary and leaves `folder` as it was; one that found the disk full raises a DiskFullError naming
    `folder`."""
    folder = Path(folder)
    for stale in folder.parent.glob(f".{folder.name}.tmp-*"):  # left by a writer that was killed
        shutil.rmtree(stale, ignore_errors=True)
    temporary = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    try:
        temporary.mkdir(parents=True)
        write(temporary)
        if folder.exists():
            shutil.rmtree(folder)  # an incomplete or stale folder from an earlier attempt
        temporary.rename(folder)
    except BaseException as error:
        shutil.rmtree(temporary, ignore_errors=True)  # before the free space is measured
        if isinstance(error, Exception):
            raise_if_disk_full(error, folder)
        raise


def raise_if_disk_full(error: BaseException, path: Path) -> None:
    """Raises a DiskFullError for `error` if it says that writing `path` found no space (or no quota) left."""
    code = disk_full_errno(error)
    if code is not None and not isinstance(error, DiskFullError):
        line = f"{DISK_FULL[code]} writing {path} ({free_space(path.parent)})"
        raise DiskFullError(code, line, str(path)) from error


def disk_full_errno(error: BaseException) -> int | None:
    """ENOSPC or EDQUOT if `error`, or an error it came from (its __cause__ or __context__, at any depth), is an
    OSError with that errno or, from a library that keeps no errno (safetensors, torch), words it so; else None.
    (torch.save to a path says only "unexpected pos": give it an open file, whose OSError becomes the context.)"""
    pending, seen = [error], set()
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno is not None:
            if error.errno in DISK_FULL:
                return error.errno
        else:
            text = str(error).lower()
            for code, words in DISK_FULL_WORDS.items():
                if any(word in text for word in words):
                    return code
        pending += [error.__context__, error.__cause__]  # the cause (popped first) before the context
    return None


def free_space(folder: Path) -> str:
    """'12.3 MiB free on /work': what the filesystem holding `folder` has left for this user, and its mount point."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return "free space unknown"
    mount = folder.resolve()
    while not os.path.ismount(mount):
        mount = mount.parent
    return f"{size(free)} free on {mount}"


def size(count: int) -> str:
    if count < 1024:
        return f"{count} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        count /= 1024
        if count < 1024 or unit == "TiB":
            return f"{count:.1f} {unit}"


def write_text_atomically(path: str | Path, text: str) -> None:
    write_atomically(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def publish_once(path: str | Path, text: str) -> bool:
    """Publishes `text` at `path` unless a file is already there (a hard link fails on an existing name, and a
    reader never sees a partial file); returns whether this call published it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        temporary.write_text(text, encoding="utf-8")
        os.link(temporary, path)
        return True
    except FileExistsError:
        return False
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise_if_disk_full(error, path)
        raise
    finally:
        temporary.unlink(missing_ok=True)
