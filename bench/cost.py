"""CPU cost of a benchmark window, per process, read from /proc (through psutil).

Throughput on a shared two-core machine moves with whatever else runs;
CPU-seconds spent per chat turn, summed over every process that serves it,
does not. Every server a benchmark measures (Ray and its workers, vLLM's
server and engine processes) is a descendant of the benchmark process, and
the load generator is the benchmark process itself, so "the servers" are
exactly this process's descendants.
"""

from __future__ import annotations

import collections
import re

import psutil


def _label(process: psutil.Process) -> str:
    """A stable name for a process: Ray's worker titles without the method
    being run (``ray::ServeReplica:load:Gateway``), else the program name."""
    try:
        line = " ".join(process.cmdline()) or process.name()
    except psutil.Error:
        return "gone"
    if line.startswith("ray::"):
        return re.split(r"[ .]", line, maxsplit=1)[0]
    if "vllm.entrypoints.openai.api_server" in line:
        return "vllm api_server"
    name = process.name()
    return {"python": "python (other)", "python3": "python (other)"}.get(name, name)


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """{pid: (label, user + system CPU-seconds so far)} of every descendant."""
    seen = {}
    for process in psutil.Process().children(recursive=True):
        try:
            times = process.cpu_times()
            seen[process.pid] = (_label(process), times.user + times.system)
        except psutil.Error:  # ended while we looked
            continue
    return seen


def own_seconds() -> float:
    """User + system CPU-seconds of this process so far (the load generator)."""
    times = psutil.Process().cpu_times()
    return times.user + times.system


def spent(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU-seconds per process label between two :func:`cpu_seconds` readings
    (a process started in between counts from zero; one that ended is lost)."""
    total: collections.Counter = collections.Counter()
    for pid, (label, seconds) in after.items():
        total[label] += seconds - before.get(pid, (label, 0.0))[1]
    return dict(total.most_common())


def per_turn(by_process: dict[str, float], turns: int) -> dict[str, float]:
    """Milli-CPU-seconds per turn, per process label and in all (``total``)."""
    scale = 1000 / max(1, turns)
    out = {label: round(seconds * scale, 2) for label, seconds in by_process.items() if seconds * scale >= 0.01}
    out["total"] = round(sum(by_process.values()) * scale, 2)
    return out


def resident_bytes(labels: set[str]) -> int:
    """Resident memory (RSS) summed over the descendants whose :func:`_label` is in ``labels``."""
    total = 0
    for process in psutil.Process().children(recursive=True):
        try:
            if _label(process) in labels:
                total += process.memory_info().rss
        except psutil.Error:
            continue
    return total
