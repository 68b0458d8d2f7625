"""Publishing files in one rename: a writer killed at any moment leaves either the old file, the new
one, or a hidden temporary that the next writer removes, never a file that looks complete."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


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
    finally:
        temporary.unlink(missing_ok=True)


def write_text_atomically(path: str | Path, text: str) -> None:
    write_atomically(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))


def publish_once(path: str | Path, text: str) -> bool:
    """Publishes `text` at `path` unless a file is already there (a hard link fails on an existing name, and a
    reader never sees a partial file); returns whether this call published it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(text, encoding="utf-8")
    try:
        os.link(temporary, path)
        return True
    except FileExistsError:
        return False
    finally:
        temporary.unlink()
