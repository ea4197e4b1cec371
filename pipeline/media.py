"""The audio a report plays, placed so that report/ opens anywhere on its own (copied to another machine,
attached to a ticket): hard links (or copies) under report/audio/, or data URIs inside the page.

    link   report/audio/<variant>/<id>.wav hard-linked to the job's wav; a copy where the file system
           refuses a link (another device, no link support)
    copy   a copy there
    embed  no files: each player carries its wav as a base64 data URI (the page grows by 4/3 of them)
"""

from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path, PurePosixPath
from urllib.parse import quote

from pipeline.atomic import TMP_MARK
from pipeline.store import JobDir

MODES = ("link", "copy", "embed")


class ReportAudio:
    def __init__(self, job: JobDir, mode: str):
        if mode not in MODES:
            raise ValueError(f"report audio mode {mode!r}: choose one of {', '.join(MODES)}")
        self.job = job
        self.mode = mode
        self.root = job.report_dir / "audio"
        self.placed: set[Path] = set()

    def src(self, wav_path: str) -> str | None:
        """The player's src for a wav (its path relative to the job), or None when the wav is gone."""
        source = self.job.path / wav_path
        if not source.is_file():
            return None
        if self.mode == "embed":
            return "data:audio/wav;base64," + base64.b64encode(source.read_bytes()).decode("ascii")
        rel = PurePosixPath(wav_path)
        rel = rel.relative_to("wavs") if rel.parts[:1] == ("wavs",) else PurePosixPath(rel.name)
        target = self.root / rel
        if not _up_to_date(source, target, link=self.mode == "link"):
            _place(source, target, link=self.mode == "link")
        self.placed.add(target)
        return quote(str(PurePosixPath("audio") / rel))

    def finish(self) -> None:
        """Delete what earlier reports placed and this one does not play."""
        if not self.root.is_dir():
            return
        for path in sorted(self.root.rglob("*"), reverse=True):  # files before their folders
            if path.is_dir():
                if not any(path.iterdir()):
                    path.rmdir()
            elif path not in self.placed:
                path.unlink()
        if not any(self.root.iterdir()):
            self.root.rmdir()


def _up_to_date(source: Path, target: Path, link: bool) -> bool:
    """True when target is source's hard link (link mode), or a copy of it: same size and modification
    time (a hard link would pass that test too, and copy mode wants a file of its own)."""
    try:
        s, t = source.stat(), target.stat()
    except FileNotFoundError:
        return False
    if (s.st_ino, s.st_dev) == (t.st_ino, t.st_dev):
        return link
    return (s.st_size, s.st_mtime_ns) == (t.st_size, t.st_mtime_ns)


def _place(source: Path, target: Path, link: bool) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}{TMP_MARK}{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        if link:
            try:
                os.link(source, tmp)
            except OSError:  # another device, or a file system without hard links
                link = False
        if not link:
            shutil.copy2(source, tmp)  # copy2 keeps the time stamp _up_to_date compares
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
