"""Append-only JSON-lines files that a failed write cannot corrupt.

Both logs rlgate keeps, the TrajectoryStore's segments and the session
journal, add whole lines per change. :func:`append_whole` writes them whole
or not at all: a write that fails part way (a full disk, an I/O error) is cut
back to where it began before the error reaches the caller, so the next
change never runs into a fragment; and a file that somehow ends mid-line (a
cut that failed too, a crash) is cut back to its last whole line before
anything more is written to it. :func:`json_lines` reads such a file and
skips, and reports, any line that is not a JSON object.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator

import pydantic_core

logger = logging.getLogger(__name__)


def json_line(entry) -> bytes:
    """``entry`` as one JSON line (UTF-8, compact, floats exact, ``Infinity`` and
    ``NaN`` as Python's ``json`` writes them), by pydantic-core's encoder: about
    8x faster than ``json.dumps`` on the token ids and logprobs the logs hold
    (a hot path: a line per turn). A string the encoder refuses (a lone
    surrogate, which valid JSON input can carry) goes through ``json.dumps``."""
    try:
        return pydantic_core.to_json(entry, inf_nan_mode="constants") + b"\n"
    except pydantic_core.PydanticSerializationError:
        return (json.dumps(entry) + "\n").encode()


def open_log(path, opener: Callable = open):
    """``path`` opened for :func:`append_whole`: binary, append (and read, to find
    a torn tail), unbuffered (a buffered file would write a failed line's rest
    again when closed)."""
    return opener(path, "a+b", buffering=0)


def append_whole(handle, data: bytes, sync: bool = False, whole_at: int | None = None) -> int:
    """Append ``data`` (whole lines) to ``handle`` (from :func:`open_log`), and
    fsync it when ``sync``; returns the file's size after it. On any error the
    file is cut back to its size before the call, and the error is raised.

    ``whole_at``: the size this call's caller last saw the file end at on a whole
    line (what the previous append returned), when it alone appends to the file:
    the file is then not looked at first (two system calls per line on a hot
    log). Forget it after an error (the cut back may have failed)."""
    fd = handle.fileno()
    start = cut_torn_tail(fd) if whole_at is None else whole_at
    try:
        view = memoryview(data)
        while view:
            view = view[handle.write(view) :]
        if sync:
            os.fsync(fd)
    except BaseException:
        try:
            os.ftruncate(fd, start)
            os.fsync(fd)
        except OSError:  # the next append cuts the fragment (cut_torn_tail)
            logger.exception("could not cut a failed write back from %s", getattr(handle, "name", fd))
        raise
    return start + len(data)


def cut_torn_tail(fd: int) -> int:
    """Cut anything past the file's last newline; returns its size then."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    end = size
    while end > 0:  # look back for the last newline, a block at a time
        begin = max(0, end - 65536)
        block = os.pread(fd, end - begin, begin)
        newline = block.rfind(b"\n")
        if newline >= 0:
            end = begin + newline + 1
            break
        end = begin
    logger.warning("cut %d bytes of a torn line from the end of a log (fd %d)", size - end, fd)
    os.ftruncate(fd, end)
    return end


def json_lines(lines: Iterable[str], bad: Callable[[str], None]) -> Iterator[tuple[str, dict]]:
    """Each line of ``lines`` that is a JSON object, with its object, up to the
    first line without its newline (a write in progress, or torn); a whole line
    that is not a JSON object is passed to ``bad`` and skipped."""
    for line in lines:
        if not line.endswith("\n"):
            return
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        if isinstance(entry, dict):
            yield line, entry
        else:
            bad(line)
