"""Modes of what is written under a temporary name and then renamed into place.

tempfile.mkstemp and mkdtemp, and safetensors' writer, create owner-only files (0600) and folders
(0700); renamed into place they keep those modes, and on a shared volume nobody else can read a
checkpoint or a job's outputs. These helpers give them the mode a plain open() or mkdir() would have:
0666 or 0777 less the process umask.
"""

from __future__ import annotations

import os
from pathlib import Path


def process_umask() -> int:
    """The process umask. Linux shows it in /proc/self/status; elsewhere it is read by setting it and
    back, which briefly changes it for other threads creating files."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def chmod_as_created(path: str | os.PathLike) -> None:
    """Give `path` the mode open() (0666) or mkdir() (0777) gives under the umask."""
    base = 0o777 if Path(path).is_dir() else 0o666
    os.chmod(path, base & ~process_umask())


def chmod_tree_as_created(root: str | os.PathLike) -> None:
    """chmod_as_created on `root` and everything under it (symlinks are left alone)."""
    mask = process_umask()
    os.chmod(root, 0o777 & ~mask)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            if not os.path.islink(os.path.join(folder, name)):
                os.chmod(os.path.join(folder, name), 0o777 & ~mask)
        for name in files:
            if not os.path.islink(os.path.join(folder, name)):
                os.chmod(os.path.join(folder, name), 0o666 & ~mask)
