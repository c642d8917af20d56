"""The SessionStore's journal: open sessions on disk, so a restarted store
resumes them instead of losing them.

One JSON line per change: ``open`` (a session and its hashed key), ``record``
(completions; a continuation's prompt as its parent and the tokens after it),
``rewards`` (the rewards of a session's completions after a ``set_reward``),
``saving`` (its export is on its way to the TrajectoryStore: from here on the
session takes no changes, since the save may reach the disk whatever its caller
hears), ``end`` (the session was exported, or dropped). Each line is written to
the operating system before the call that made it returns, whole or not at all
(:func:`rlgate.logfile.append_whole`: a failed write is cut back and raised, so
the change is refused, not half-noted): a killed process loses nothing; a
machine that loses power may lose the last lines (the trajectories themselves
are fsync'd by the TrajectoryStore).

:meth:`SessionJournal.replay` rebuilds the open sessions and recently ended
keys; the file is then rewritten with just those (``compact``), and again
whenever it grows past ``compact_bytes``, so it stays the size of what is open.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from rlgate.logfile import append_whole, json_line, json_lines, open_log
from rlgate.sessions.trajectory import Interaction, SessionTrajectory

logger = logging.getLogger(__name__)
COMPACT_BYTES = 64 * 2**20
# Memory a replayed journal takes per byte of file, with room to spare (token ids and
# logprobs as Python objects in lists), plus a list slot for each token a continuation's
# prompt takes from its parent: the file holds it once, each turn's prompt list again.
# Measured (tracemalloc) for sessions of 4, 10, 30 and 50 turns: 4.0x, 7.4x, 13.2x and
# 18.4x the file; this estimate: 8.8x, 11.5x, 17.5x and 22.7x. (Measured when sessions held lists: a replayed
# prompt is now a list only while it is added, and held compactly after, so the estimate errs high.)
REPLAY_EXPANSION = 8
SLOT_BYTES = 8
ENDED_MEMORY_S = 24 * 3600.0  # ended keys kept (for 410 answers) across a restart
OPEN_FIELDS = ("task_id", "key_hash", "created_at", "group_size", "train")  # every open line has them


def open_session_ids(folder: str | Path) -> set[str]:
    """The ids of the sessions still open in every journal under ``folder`` (a run's
    ``sessions/``: the SessionStore's and each colocated replica's), read without
    rebuilding their turns: the sessions the run's next stores take back."""
    ids: set[str] = set()
    for path in Path(folder).glob("**/journal.jsonl"):
        with open(path, encoding="utf-8") as handle:
            for _, entry in json_lines(handle, lambda line: None):  # a bad line is the replay's to report
                if entry.get("op") == "open":
                    ids.add(entry.get("id"))
                elif entry.get("op") == "end":
                    ids.discard(entry.get("id"))
    return ids


class JournalTooBig(Exception):
    """The journal cannot be read back in the memory there is."""


class SessionJournal:
    def __init__(self, path: str | Path, compact_bytes: int = COMPACT_BYTES) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.compact_bytes = compact_bytes
        self._compacted = 0  # the size the last compaction left
        self._file = open_log(self.path)
        self._end: int | None = None  # where the file ends on a whole line, once this journal has written it

    def _write(self, entry: dict) -> None:
        end, self._end = self._end, None  # forgotten if the append fails: the next one looks at the file
        self._end = append_whole(self._file, json_line(entry), whole_at=end)

    # --- changes -------------------------------------------------------------------

    def opened(self, session) -> None:
        self._write(
            {
                "op": "open",
                "id": session.id,
                "task_id": session.task_id,
                "key_hash": session.key_hash,
                "group_size": session.group_size,
                "train": session.train,
                "follow_template": session.follow_template,
                "created_at": session.trajectory.created_at,
            }
        )

    def recorded(self, session_id: str, interactions: list[Interaction], earlier: dict[str, Interaction]) -> None:
        """Note ``interactions`` of a session whose interactions so far are ``earlier``
        (by id). A prompt shared by several interactions (the n choices of one request)
        is written once; a continuation's prompt as its parent's id and the tokens after
        the parent's prompt and completion, so a long session journals each token once,
        not once a turn."""
        prompts: list[list[int] | dict] = []
        at: dict[int, int] = {}
        entries = []
        for interaction in interactions:
            index = at.setdefault(id(interaction.prompt_ids), len(prompts))
            if index == len(prompts):
                prompts.append(_as_continuation(interaction, earlier) or list(interaction.prompt_ids))
            entries.append({**vars(interaction), "prompt_ids": index, **_as_lists(interaction)})
        self._write({"op": "record", "id": session_id, "prompts": prompts, "interactions": entries})

    def rewarded(self, session) -> None:
        rewards = {i.id: i.reward for i in session.trajectory.interactions.values() if i.reward is not None}
        self._write({"op": "rewards", "id": session.id, "rewards": rewards})

    def saving(self, session_id: str) -> None:
        self._write({"op": "saving", "id": session_id})

    def ended(self, session_id: str, key_hash: str, at: float) -> None:
        self._write({"op": "end", "id": session_id, "key_hash": key_hash, "at": at})

    # --- recovery ------------------------------------------------------------------

    def replay(self, available: int | None = None) -> tuple[list[dict], dict[str, float]]:
        """The sessions still open (each ``open`` entry's fields plus its
        ``trajectory``) and the keys ended within ``ENDED_MEMORY_S`` (key hash ->
        when). A torn last line (the process died while writing it) is ignored.

        Raises :class:`JournalTooBig` when the journal would not fit in
        ``available`` bytes of memory (default: what the machine has free) once
        read: replaying it would kill the process, and its restart would again."""
        size = self.path.stat().st_size if self.path.exists() else 0
        if available is None:
            import psutil

            available = psutil.virtual_memory().available
        if size * REPLAY_EXPANSION > available:
            raise self._too_big(size, available)
        sessions: dict[str, dict] = {}
        ended: dict[str, float] = {}
        shared = [0]  # tokens continuations took from their parents so far (a line applied in part counts too)
        for entry in self._entries():
            try:
                self._apply(entry, sessions, ended, shared)
            except Exception as err:  # one bad line costs that line, not the store (nor a restart loop)
                logger.warning("journal %s: skipped an entry it cannot apply (%s): %.200s", self.path, err, entry)
            if size * REPLAY_EXPANSION + SLOT_BYTES * shared[0] > available:  # stopped before it would run out
                raise self._too_big(size, available)
        cutoff = time.time() - ENDED_MEMORY_S
        live_keys = {s["key_hash"] for s in sessions.values()}
        ended = {k: at for k, at in ended.items() if at >= cutoff and k not in live_keys}
        return list(sessions.values()), ended

    def _too_big(self, size: int, available: int) -> JournalTooBig:
        return JournalTooBig(
            f"the session journal {self.path} ({size / 2**20:.0f} MiB) is too big to read back in the "
            f"{available / 2**20:.0f} MiB of memory free here (about {REPLAY_EXPANSION}x its size is needed, "
            "more for long sessions): its sessions are not served. Give this process more memory, or move the "
            "file away (its sessions are then lost) and restart; [gateway] max_session_tokens and max_concurrent "
            "bound how big it can grow"
        )

    @staticmethod
    def _apply(entry: dict, sessions: dict[str, dict], ended: dict[str, float], shared: list[int]) -> None:
        """Apply one entry, adding to ``shared[0]`` the tokens its prompts take from their parents."""
        op, session_id = entry["op"], entry.get("id")
        if op == "open":
            for field in OPEN_FIELDS:  # what taking the session back reads
                entry[field]
            trajectory = SessionTrajectory(session_id, entry["task_id"])
            trajectory.created_at = entry["created_at"]
            sessions[session_id] = {**entry, "trajectory": trajectory}
        elif op == "record" and session_id in sessions:
            trajectory = sessions[session_id]["trajectory"]
            prompts = entry.get("prompts")  # absent in journals written before prompts were shared
            for fields in entry["interactions"]:
                if prompts is not None:
                    index = fields["prompt_ids"]
                    if isinstance(prompts[index], dict):  # a continuation: its parent's sequence, then the rest
                        sequence = trajectory.interactions[prompts[index]["parent"]].sequence
                        prompts[index] = sequence + prompts[index]["after"]
                        shared[0] += len(sequence)
                    fields["prompt_ids"] = prompts[index]  # shared again, as when recorded
                trajectory.add(Interaction(**fields))
        elif op == "saving" and session_id in sessions:
            sessions[session_id]["save_failed"] = True  # whether it reached the disk is not known
        elif op == "rewards" and session_id in sessions:
            interactions = sessions[session_id]["trajectory"].interactions
            for interaction_id, reward in entry["rewards"].items():
                if interaction_id in interactions:
                    interactions[interaction_id].reward = reward
        elif op == "end":
            at = float(entry["at"])
            sessions.pop(session_id, None)
            ended[entry["key_hash"]] = at
        elif op == "ended":  # a compacted file's memory of ended keys
            ended[entry["key_hash"]] = float(entry["at"])

    def _entries(self):
        if not self.path.exists():
            return

        def bad(line: str) -> None:
            logger.warning("journal %s: skipped a line that is not a JSON object: %.200s", self.path, line)

        with open(self.path, encoding="utf-8") as handle:
            for _, entry in json_lines(handle, bad):  # up to a torn last line: never acknowledged
                yield entry

    def compact(self, sessions, ended: dict[str, float]) -> None:
        """Rewrite the journal as just ``sessions`` (live Session objects) and the
        ``ended`` keys, atomically; on an error the journal stays as it was."""
        temporary = self.path.with_suffix(".tmp")
        temporary.unlink(missing_ok=True)
        previous, previous_end = self._file, self._end
        try:
            with open_log(temporary) as self._file:
                self._end = None
                cutoff = time.time() - ENDED_MEMORY_S
                for key_hash, at in ended.items():
                    if at >= cutoff:
                        self._write({"op": "ended", "key_hash": key_hash, "at": at})
                for session in sessions:
                    self.opened(session)
                    if interactions := session.trajectory.interactions:
                        self.recorded(session.id, list(interactions.values()), interactions)
                    if session.ending or session.save_failed:  # an export may be on the disk already
                        self.saving(session.id)
                os.fsync(self._file.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        finally:
            self._file, self._end = previous, previous_end
        self._file.close()
        self._file, self._end = open_log(self.path), None
        self._compacted = self._file.tell()

    def too_big(self) -> bool:
        """Past ``compact_bytes`` and twice what the last compaction left (so a journal
        whose open sessions alone are that big is not rewritten at every change)."""
        return self._file.tell() > max(self.compact_bytes, 2 * self._compacted)

    def close(self) -> None:
        self._file.close()


def _as_lists(interaction: Interaction) -> dict[str, list]:
    """Its completion's tokens, logprobs and versions as JSON lists (a recorded one holds arrays)."""
    return {name: list(getattr(interaction, name)) for name in ("completion_ids", "logprobs", "versions")}


def _as_continuation(interaction: Interaction, earlier: dict[str, Interaction]) -> dict | None:
    """``{"parent": id, "after": tokens}`` where ``interaction``'s prompt is its
    parent's prompt and completion followed by ``after``; else None."""
    parent = earlier.get(interaction.parent) if interaction.parent is not None else None
    if parent is None or not interaction.continues(parent):
        return None  # (one that names a parent it does not continue is refused by the trajectory, then as now)
    return {"parent": parent.id, "after": interaction.prompt_ids[len(parent.prompt_ids) + len(parent.completion_ids) :]}
