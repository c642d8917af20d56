"""Exact trajectories: the token-level record of one session, and its export.

A session is a tree of *interactions*, one per completion the engine produced.
An interaction whose prompt continued an earlier exchange verbatim (its
messages extend the earlier prompt plus that completion) has that earlier
interaction as ``parent``; its ``prompt_ids`` then start with the parent's
``prompt_ids + completion_ids``, token for token. A request that does not
continue anything starts a new root. Each root-to-leaf path is one
conversation branch.

Export styles:

* ``individual``: one sample per interaction: its prompt and completion,
  loss mask over the completion only.
* ``concat``: one sample per branch: the leaf's full sequence, loss mask over
  every completion along the path (earlier completions sit verbatim inside
  later prompts), so a multi-turn, tool-calling episode is one sequence.

Rewards propagate backwards with ``turn_discount`` (γ): an interaction's
return is its own reward (0 when unset) plus γ times the return of what came
after it; where a conversation branched, "what came after" is the mean over
the branches. Pure Python: no Ray, no torch.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, NotRequired, TypedDict

ExportStyle = Literal["individual", "concat"]
NO_VERSION = -1  # version recorded for tokens the model did not sample (prompt tokens)


class Tokens(Sequence[int]):
    """A recorded prompt's token ids, held compactly: as 4-byte ints, and a
    continuation's as its parent's prompt and completion followed by the tokens
    after them, so a session holds each token once rather than once a turn (a
    Python list of ids takes ~36 bytes a token, and each turn's prompt repeats
    every earlier one: ten turns on a 2,000-token prompt growing 400 a turn took
    1.8 MB, now ~60 KB with their completions). Reads as a read-only list of ints:
    ``len``, indexing and slices (a list), iteration, ``+`` (a list) and ``==`` with
    any sequence of ints; each builds the ids anew (O(length): kept off per-token
    loops). Made by :meth:`SessionTrajectory.add`; pickles as its ids alone."""

    __slots__ = ("_after", "_len", "_parent")

    def __init__(self, after: Sequence[int], parent: Interaction | None = None) -> None:
        self._after = after if isinstance(after, array) and after.typecode == "i" else array("i", after)
        self._parent = parent
        self._len = len(self._after) + (len(parent.prompt_ids) + len(parent.completion_ids) if parent else 0)

    def ids(self) -> array:
        """Every id, in one array (built anew: the parents' prompts, completions, then this one's own)."""
        pieces, tokens = [], self
        while tokens._parent is not None:
            pieces += [tokens._after, tokens._parent.completion_ids]
            tokens = tokens._parent.prompt_ids
        out = array("i", tokens._after)
        for piece in reversed(pieces):  # arrays, all: a parent is an interaction already added
            out.extend(piece)
        return out

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.ids()[index].tolist()
        if self._parent is None:
            return self._after[index]
        return self.ids()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids())

    def __eq__(self, other) -> bool:
        if isinstance(other, Tokens):
            return self._len == other._len and self.ids() == other.ids()
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            if self._len != len(other):
                return False
            try:
                return self.ids() == (other if isinstance(other, array) else array("i", other))
            except (TypeError, OverflowError):  # not all ints, or beyond any token id
                return False
        return NotImplemented

    __hash__ = None  # mutable-looking, as a list

    def __add__(self, other: Sequence[int]) -> list[int]:
        return self.ids().tolist() + list(other)

    def __radd__(self, other: Sequence[int]) -> list[int]:
        return list(other) + self.ids().tolist()

    def __repr__(self) -> str:
        return f"Tokens({self.ids().tolist()!r})"

    def __reduce__(self):
        return Tokens, (self.ids(),)


@dataclass
class Interaction:
    """One completion: what the engine saw and what it produced. Made with lists;
    :meth:`SessionTrajectory.add` holds its prompt as :class:`Tokens` and the rest as
    arrays (``i``, ``d``: a long session's memory), which read as lists do."""

    id: str
    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    logprobs: Sequence[float]
    versions: Sequence[int]
    finish_reason: str | None
    parent: str | None = None
    reward: float | None = None
    temperature: float = 1.0  # the sampling temperature: behaviour logprobs are of softmax(logits / temperature)
    key: str | None = None  # hash of (tools, messages + the returned assistant message), for continuations
    created_at: float = field(default_factory=time.time)
    adapter: str | None = None  # the LoRA adapter that served it (``v<version>``; a pool run's ``<run>-v<version>``)

    def __post_init__(self) -> None:
        if not (len(self.completion_ids) == len(self.logprobs) == len(self.versions)):
            raise ValueError("completion_ids, logprobs and versions must have the same length")

    @property
    def sequence(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def continues(self, parent: Interaction) -> bool:
        """Whether this prompt starts with ``parent``'s prompt and completion, token for token."""
        start, end = len(parent.prompt_ids), len(parent.prompt_ids) + len(parent.completion_ids)
        completion = list(parent.completion_ids)  # slices of a prompt are lists; a recorded completion an array
        return self.prompt_ids[:start] == parent.prompt_ids and self.prompt_ids[start:end] == completion


class TrajectoryRecord(TypedDict):
    """A saved trajectory as it crosses processes and sits in the trajectory log:
    a :class:`Sample`'s fields, how its session ended, and the log's sequence
    number (set by the TrajectoryStore when it is appended). What the driver
    batches, the trainer collates and ``rlgate trajectories export`` reads."""

    session_id: str
    task_id: str
    style: ExportStyle
    interaction_ids: list[str]
    rewards: list[float]
    reward: float
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reasons: list[str | None]
    created_at: float
    ended_at: float
    temperatures: list[float]
    failed: bool
    end_reason: str  # ended, failed, expired, refreshed, restart, ...
    adapters: NotRequired[list[str | None]]  # per interaction listed: the LoRA adapter that served it
    group_size: NotRequired[int]  # the group the session started in, when it said
    seq: NotRequired[int]  # its place in the log, from 1, gap-free


@dataclass
class Sample:
    """One exported training sample (a JSON record in the trajectory files)."""

    session_id: str
    task_id: str
    style: ExportStyle
    interaction_ids: list[str]
    rewards: list[float]  # the return of each interaction listed, in order
    reward: float  # the sample's reward: the return of its first interaction
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reasons: list[str | None]
    created_at: float
    ended_at: float
    temperatures: list[float] = field(default_factory=list)  # per token: sampling temperature (1.0 elsewhere)
    failed: bool = False  # the episode failed (e.g. its environment errored): a marker, nothing to train on
    adapters: list[str | None] = field(default_factory=list)  # per interaction listed: the LoRA adapter that served it

    def record(self, end_reason: str, group_size: int | None = None) -> TrajectoryRecord:
        """This sample as the log keeps it (fields are flat: no deep copy)."""
        record: TrajectoryRecord = {**vars(self), "end_reason": end_reason}
        if group_size:
            record["group_size"] = group_size
        return record


class SessionTrajectory:
    """The interaction tree of one session; pure bookkeeping."""

    def __init__(self, session_id: str, task_id: str) -> None:
        self.session_id = session_id
        self.task_id = task_id
        self.interactions: dict[str, Interaction] = {}  # insertion order = creation order
        self._by_key: dict[str, str] = {}
        self.created_at = time.time()

    def __len__(self) -> int:
        return len(self.interactions)

    def add(self, interaction: Interaction) -> None:
        if interaction.id in self.interactions:
            raise ValueError(f"interaction {interaction.id} already recorded")
        parent = None
        if interaction.parent is not None:
            if interaction.parent not in self.interactions:
                raise ValueError(f"unknown parent interaction {interaction.parent!r}")
            parent = self.interactions[interaction.parent]
            if not interaction.continues(parent):
                raise ValueError("a continuation must start with its parent's prompt and completion ids")
        interaction.prompt_ids = self._held(interaction.prompt_ids, parent)
        interaction.completion_ids = array("i", interaction.completion_ids)  # 4 bytes a token, not ~36
        interaction.logprobs, interaction.versions = array("d", interaction.logprobs), array("i", interaction.versions)
        self.interactions[interaction.id] = interaction
        if interaction.key is not None:
            self._by_key[interaction.key] = interaction.id

    def _held(self, prompt: Sequence[int], parent: Interaction | None) -> Tokens:
        """``prompt`` as this trajectory holds it: the latest interaction's when they
        are the same (the n choices of one request), else its own :class:`Tokens`."""
        latest = self.interactions[next(reversed(self.interactions))] if self.interactions else None
        if latest is not None and latest.parent == (parent and parent.id) and latest.prompt_ids == prompt:
            return latest.prompt_ids
        start = len(parent.prompt_ids) + len(parent.completion_ids) if parent is not None else 0
        return Tokens(prompt[start:] if start else prompt, parent)

    def find(self, keys: list[str]) -> Interaction | None:
        """The interaction whose key is the latest of ``keys`` recorded (the longest
        earlier exchange a new request continues), or None."""
        for key in reversed(keys):
            if key in self._by_key:
                return self.interactions[self._by_key[key]]
        return None

    def set_reward(self, reward: float, interaction_id: str | None = None) -> str:
        """Set the reward of one interaction (default: the latest); return its id."""
        if not self.interactions:
            raise LookupError("this session has no completions to reward yet")
        if interaction_id is None:
            interaction_id = next(reversed(self.interactions))
        if interaction_id not in self.interactions:
            raise LookupError(f"no interaction {interaction_id!r} in this session")
        self.interactions[interaction_id].reward = float(reward)
        return interaction_id

    def set_turn_rewards(self, turn_rewards: list[float], final: float) -> str:
        """The i-th reward on the i-th completion (creation order), then ``final``
        added to the latest; returns the latest's id."""
        if len(turn_rewards) > len(self.interactions):
            raise LookupError(f"{len(turn_rewards)} turn rewards for {len(self.interactions)} completions")
        if not self.interactions:
            raise LookupError("this session has no completions to reward yet")
        for interaction, reward in zip(self.interactions.values(), turn_rewards):
            interaction.reward = float(reward)
        latest = self.interactions[next(reversed(self.interactions))]
        latest.reward = (latest.reward if len(turn_rewards) == len(self.interactions) else 0.0) + float(final)
        return latest.id

    def children(self) -> dict[str | None, list[str]]:
        tree: dict[str | None, list[str]] = {}
        for interaction in self.interactions.values():
            tree.setdefault(interaction.parent, []).append(interaction.id)
        return tree

    def returns(self, turn_discount: float) -> dict[str, float]:
        """Discounted return of every interaction (see the module docstring)."""
        tree = self.children()
        result: dict[str, float] = {}
        for interaction_id in reversed(list(self.interactions)):  # children are created after parents
            after = [result[child] for child in tree.get(interaction_id, [])]
            future = sum(after) / len(after) if after else 0.0
            own = self.interactions[interaction_id].reward or 0.0
            result[interaction_id] = own + turn_discount * future
        return result

    def branches(self) -> list[list[Interaction]]:
        """Every root-to-leaf path, leaves in creation order."""
        tree = self.children()
        paths = []
        for interaction in self.interactions.values():
            if interaction.id in tree:
                continue  # not a leaf
            path = [interaction]
            while path[-1].parent is not None:
                path.append(self.interactions[path[-1].parent])
            paths.append(path[::-1])
        return paths

    def export(self, style: ExportStyle, turn_discount: float = 1.0) -> list[Sample]:
        returns = self.returns(turn_discount)
        ended = time.time()
        if style == "individual":
            return [self._individual(i, returns, ended) for i in self.interactions.values()]
        if style == "concat":
            return [self._concat(path, turn_discount, ended) for path in self.branches()]
        raise ValueError(f"unknown export style {style!r}; expected 'individual' or 'concat'")

    def failure(self, style: ExportStyle) -> Sample:
        """The record of a failed episode: no tokens, but it still counts as a member
        of its GRPO group, so the group completes without waiting for it."""
        return Sample(
            session_id=self.session_id,
            task_id=self.task_id,
            style=style,
            interaction_ids=[],
            rewards=[],
            reward=0.0,
            input_ids=[],
            loss_mask=[],
            logprobs=[],
            versions=[],
            finish_reasons=[],
            created_at=self.created_at,
            ended_at=time.time(),
            failed=True,
        )

    def _individual(self, interaction: Interaction, returns: dict[str, float], ended: float) -> Sample:
        prompt = len(interaction.prompt_ids)
        return Sample(
            session_id=self.session_id,
            task_id=self.task_id,
            style="individual",
            interaction_ids=[interaction.id],
            rewards=[returns[interaction.id]],
            reward=returns[interaction.id],
            input_ids=interaction.sequence,
            loss_mask=[0] * prompt + [1] * len(interaction.completion_ids),
            logprobs=[0.0] * prompt + interaction.logprobs.tolist(),
            versions=[NO_VERSION] * prompt + interaction.versions.tolist(),
            temperatures=[1.0] * prompt + [interaction.temperature] * len(interaction.completion_ids),
            finish_reasons=[interaction.finish_reason],
            adapters=[interaction.adapter],
            created_at=interaction.created_at,
            ended_at=ended,
        )

    def _concat(self, path: list[Interaction], turn_discount: float, ended: float) -> Sample:
        leaf = path[-1]
        length = len(leaf.sequence)
        loss_mask, logprobs, versions = [0] * length, [0.0] * length, [NO_VERSION] * length
        temperatures = [1.0] * length
        for step in path:  # each completion sits verbatim at the same offset in the leaf's sequence
            start = len(step.prompt_ids)
            for offset in range(len(step.completion_ids)):
                loss_mask[start + offset] = 1
                logprobs[start + offset] = step.logprobs[offset]
                versions[start + offset] = step.versions[offset]
                temperatures[start + offset] = step.temperature
        # Returns along this branch only (no averaging over other branches).
        path_returns, future = [], 0.0
        for step in reversed(path):
            future = (step.reward or 0.0) + turn_discount * future
            path_returns.append(future)
        path_returns.reverse()
        return Sample(
            session_id=self.session_id,
            task_id=self.task_id,
            style="concat",
            interaction_ids=[step.id for step in path],
            rewards=path_returns,
            reward=path_returns[0],
            input_ids=leaf.sequence,
            loss_mask=loss_mask,
            logprobs=logprobs,
            temperatures=temperatures,
            versions=versions,
            finish_reasons=[step.finish_reason for step in path],
            adapters=[step.adapter for step in path],
            created_at=path[0].created_at,
            ended_at=ended,
        )
