"""The token-in, token-out engine interface shared by every rollout engine.

An engine takes prompt token ids and sampling parameters and streams
:class:`TokenChunk` deltas: the sampled token ids, the behaviour logprob of
each, the policy version that produced each, and finally a finish reason.
Weights are replaced in place with :meth:`Engine.update_weights`, between a
pause and a resume, and every token sampled afterwards carries the new version.

Pure data and the abstract base live here; engines import their heavy
dependencies (vllm, transformers) in their own modules.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import os
import struct
from collections import deque
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlgate.background import keep, to_its_end

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "abort"]

# vLLM's floors, applied here so every engine (and the trainer, which replays
# the recorded temperature) agrees: below GREEDY_BELOW sampling is greedy, and
# a temperature under MIN_TEMPERATURE is raised to it. Logits over 1e-300
# overflow to inf and NaN, which failed a whole batch on the HF engine.
GREEDY_BELOW = 1e-5
MIN_TEMPERATURE = 1e-2


class SamplingParams(BaseModel):
    """Sampling parameters of one generation request (OpenAI names where they exist)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, ge=1, description="Most tokens to generate per completion.")
    temperature: float = Field(
        1.0, ge=0.0, le=100.0, description="0 (or below 1e-5) means greedy; (0, 0.01) is raised to 0.01."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 disables.")
    stop: tuple[str, ...] = Field((), description="Stop strings (matched on decoded text).")
    stop_token_ids: tuple[int, ...] = Field((), description="Token ids that end a completion.")
    seed: int | None = Field(None, description="Seed for reproducible sampling.")
    n: int = Field(1, ge=1, le=128, description="Completions per prompt.")
    top_logprobs: int = Field(0, ge=0, le=20, description="Alternatives reported per token.")
    ignore_eos: bool = Field(False, description="Keep going past the end-of-sequence token.")
    structured: tuple[str, str] | None = Field(
        None,
        description="A constraint on the output, as vLLM's structured outputs take it: (kind, text), e.g. "
        "('structural_tag', its JSON), ('json', a JSON schema's JSON), ('regex', a pattern). The behaviour "
        "logprobs are those of the constrained distribution the tokens were sampled from.",
    )

    @field_validator("temperature")
    @classmethod
    def _floor(cls, value: float) -> float:
        if value < GREEDY_BELOW:
            return 0.0
        return max(value, MIN_TEMPERATURE)


@dataclass
class TokenChunk:
    """A streamed delta of one completion (``index`` among the ``n``).

    ``logprobs[i]`` is the behaviour logprob of ``token_ids[i]`` under the
    distribution it was sampled from (after temperature, top-k and top-p);
    ``versions[i]`` is the policy version whose weights produced it.
    ``finish_reason`` is set on the last chunk of a completion only;
    ``stop_reason`` is the stop string or token id that ended it, if any;
    ``adapter`` names the LoRA adapter that produced it (None: the model's own weights).
    """

    index: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    adapter: str | None = None


@dataclass
class Completion:
    """A whole completion, assembled from its chunks (see :func:`collect`)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    adapter: str | None = None

    def add(self, chunk: TokenChunk) -> None:
        """Append a chunk of this completion."""
        self.adapter = chunk.adapter
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.versions += chunk.versions
        if chunk.top_logprobs is not None:
            self.top_logprobs = (self.top_logprobs or []) + chunk.top_logprobs
        if chunk.finish_reason is not None:
            self.finish_reason, self.stop_reason = chunk.finish_reason, chunk.stop_reason


async def collect(stream: AsyncIterator[TokenChunk], n: int = 1) -> list[Completion]:
    """Drain a chunk stream into ``n`` whole completions."""
    completions = [Completion(index=i) for i in range(n)]
    async for chunk in stream:
        completions[chunk.index].add(chunk)
    return completions


class RequestLog:
    """The last ``size`` finished requests exactly as the engine saw and answered
    them (prompt ids, each output's ids, logprobs and versions), for audits and
    tests; ``size`` 0 keeps nothing and costs nothing."""

    def __init__(self, size: int) -> None:
        self.entries: deque[dict] = deque(maxlen=size)

    def tap(self, prompt_ids: list[int], n: int, stream: AsyncIterator[TokenChunk]) -> AsyncIterator[TokenChunk]:
        """``stream`` passed through, logged once it has finished (itself, untouched, when off)."""
        return self._logged(prompt_ids, n, stream) if self.entries.maxlen else stream

    async def _logged(self, prompt_ids, n, stream):
        outputs = [Completion(index=i) for i in range(n)]
        async for chunk in stream:
            outputs[chunk.index].add(chunk)
            yield chunk
        self.entries.append({"prompt_ids": list(prompt_ids), "outputs": [asdict(o) for o in outputs]})

    def recent(self, count: int) -> list[dict]:
        """The last ``count`` entries, oldest first."""
        return list(self.entries)[-count:]


@dataclass
class WeightUpdateReport:
    version: int
    seconds: float
    tensors: int


@dataclass
class EngineHealth:
    ready: bool
    engine: str
    model: str
    version: int
    paused: bool
    running_requests: int


class EngineInputError(ValueError):
    """A request the engine cannot serve (empty or over-long prompt, unknown token id)."""


class WeightsMismatchError(ValueError):
    """An update whose tensor names or shapes do not match the served model."""


# A checkpoint entry: shape and dtype name (safetensors spelling, e.g. "F32").
TensorSpec = tuple[tuple[int, ...], str]


def read_safetensors_specs(path: str | Path) -> dict[str, TensorSpec]:
    """Names, shapes and dtypes of the tensors in a safetensors file, or in every
    safetensors file of a model folder, read from the headers only."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    specs: dict[str, TensorSpec] = {}
    for file in files:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        header.pop("__metadata__", None)
        for name, entry in header.items():
            specs[name] = (tuple(entry["shape"]), entry["dtype"])
    return specs


def check_update(
    shapes: Mapping[str, tuple[int, ...]], expected: Mapping[str, TensorSpec], tied_lm_head: bool
) -> list[str]:
    """Validate a full weight update (name -> shape) against the served checkpoint.

    Returns the names to load: a tied ``lm_head.weight`` is left out, it is the
    embedding. Raises :class:`WeightsMismatchError` listing every missing,
    unexpected or mis-shaped name before anything is loaded, because a reload
    that fails halfway leaves the engine in an unknown state and a partial
    update of a fused layer (q/k/v, gate/up) is silently wrong.
    """
    names = {name for name in shapes if not (tied_lm_head and name == "lm_head.weight")}
    missing = sorted(set(expected) - names)
    unexpected = sorted(names - set(expected))
    misshaped = [
        f"{name}: got {tuple(shapes[name])}, expected {expected[name][0]}"
        for name in sorted(names & set(expected))
        if tuple(shapes[name]) != expected[name][0]
    ]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:8])}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensor(s): {', '.join(unexpected[:8])}")
    if misshaped:
        problems.append(f"wrong shape: {'; '.join(misshaped[:8])}")
    if problems:
        raise WeightsMismatchError(
            "weight update does not match the served model (send the full state_dict "
            "with Hugging Face names): " + " | ".join(problems)
        )
    return sorted(names)


class Engine(abc.ABC):
    """A rollout engine: token-in, token-out generation with in-place weight updates.

    Pausing nests: the engine runs again when every :meth:`pause` has been
    matched by a :meth:`resume`. Requests that arrive while paused wait.
    :meth:`pause` returns once the engine is paused, also when another pause
    is still stopping it; a pause that fails or whose caller is cancelled does
    not count (nothing will resume it), and a cancelled resume still resumes.
    """

    name: str = "engine"
    structured_outputs: bool = False  # can constrain output (SamplingParams.structured)

    def __init__(self, model_path: str | Path, max_model_len: int, initial_version: int = 0) -> None:
        self.model_path = str(model_path)
        self.max_model_len = max_model_len
        self.vocab_size = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
        self.version = initial_version
        self._pause_depth = 0  # pauses not yet resumed
        self._stopped = False  # what the engine's scheduling is: changed only by _settle, under its lock
        self._pause_lock = asyncio.Lock()
        self._update_lock = asyncio.Lock()

    @abc.abstractmethod
    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, whole: bool = False
    ) -> AsyncIterator[TokenChunk]:
        """Stream the completions of ``prompt_ids`` as :class:`TokenChunk` deltas.
        ``whole``: the caller only collects finished completions, so an engine may
        send each once, finished (vLLM then skips its per-token outputs)."""

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Refuse prompts the model cannot take; cap ``max_tokens`` at the context end
        (such completions finish with ``length``)."""
        if not prompt_ids:
            raise EngineInputError("the prompt is empty; send at least one token id")
        if len(prompt_ids) >= self.max_model_len:
            raise EngineInputError(
                f"the prompt has {len(prompt_ids)} tokens; this model's context holds "
                f"{self.max_model_len}, so prompts may have at most {self.max_model_len - 1}"
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineInputError(f"token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        if params.structured is not None and not self.structured_outputs:
            raise EngineInputError(
                "constrained output (response_format, or a forced tool_choice) needs the vLLM engine "
                '([rollout] engine = "vllm"); this engine samples freely'
            )
        room = self.max_model_len - len(prompt_ids)
        return params if params.max_tokens <= room else params.model_copy(update={"max_tokens": room})

    @abc.abstractmethod
    async def _load_weights(self, weights: Mapping[str, torch.Tensor] | str) -> int:
        """Load a full state dict (or a safetensors file path) while paused; return tensor count."""

    @abc.abstractmethod
    async def _set_paused(self, paused: bool) -> None:
        """Stop or restart scheduling; in-flight requests are kept, new ones wait."""

    @abc.abstractmethod
    def running_requests(self) -> int: ...

    async def ready(self) -> None:
        """Finish start-up (load the model); idempotent."""

    async def shutdown(self) -> None:
        """Release the engine's processes and memory."""

    async def check_alive(self) -> None:
        """Raise if the engine can no longer serve (used as a liveness probe)."""

    async def pause(self) -> None:
        self._pause_depth += 1
        try:
            await to_its_end(self._settle(), "an engine pause")
        except BaseException:  # it does not count: let the engine run again if no other pause holds it
            self._pause_depth -= 1
            keep(self._settle(), "an engine resume after a failed pause")
            raise

    async def resume(self) -> None:
        if self._pause_depth == 0:
            raise RuntimeError("resume() without a matching pause()")
        self._pause_depth -= 1  # counted at once: a resume cancelled below still resumes
        await to_its_end(self._settle(), "an engine resume")

    async def _settle(self) -> None:
        """Bring the engine's scheduling to what the pauses held say, one change at a time."""
        async with self._pause_lock:
            stop = self._pause_depth > 0
            if stop != self._stopped:
                await self._set_paused(stop)
                self._stopped = stop

    @asynccontextmanager
    async def paused(self):
        await self.pause()
        try:
            yield
        finally:
            await self.resume()

    async def update_weights(
        self, weights: Mapping[str, torch.Tensor] | str | Path, version: int
    ) -> WeightUpdateReport:
        """Replace the weights in place and tag later tokens with ``version``.

        ``weights`` is a full state dict with Hugging Face names, or the path of
        a safetensors file holding one. Runs pause → load → reset prefix cache →
        resume; in-flight requests continue on the new weights afterwards, their
        KV cache computed again on them (each later token is exactly the new version's).
        It runs to its end if the caller is cancelled: cut short mid-load, the engine
        would serve the new weights under the old version.
        """
        return await to_its_end(self._update(weights, version), f"the weight update to version {version}")

    async def _update(self, weights: Mapping[str, torch.Tensor] | str | Path, version: int) -> WeightUpdateReport:
        loop = asyncio.get_running_loop()
        async with self._update_lock:
            # checked under the lock: two updates waiting for it apply in turn, never the older last
            if version < self.version:
                raise ValueError(f"version {version} is older than the served version {self.version}")
            async with self.paused():
                started = loop.time()
                count = await self._load_weights(str(weights) if isinstance(weights, Path) else weights)
                self.version = version
                await self._after_update(version)
                seconds = loop.time() - started
        return WeightUpdateReport(version=version, seconds=seconds, tensors=count)

    async def _after_update(self, version: int) -> None:
        """Hook run while still paused, after the new version is set."""

    async def health(self) -> EngineHealth:
        return EngineHealth(
            ready=True,
            engine=self.name,
            model=self.model_path,
            version=self.version,
            paused=self._pause_depth > 0,
            running_requests=self.running_requests(),
        )


async def liveness_probe(engine: Engine, stopping: bool = False) -> None:
    """A Serve replica's liveness probe (its ``check_health``) of the engine it holds.

    An engine that fails it is dead for good (vLLM's engine core gone, the HF
    engine's loop ended), so the replica's process ends itself, unless Serve is
    stopping the replica (``stopping``: its engine goes on purpose). Serve replaces
    a replica that died at once, where one that only fails its probe is replaced
    after three in a row (30 s more of 503s). An end like a SIGKILL's, which the
    session journals and the engine reaper already make safe."""
    try:
        await engine.check_alive()
    except Exception:
        if stopping:
            raise
        logger.exception("rollout engine is dead; ending this replica so Serve replaces it now")
        try:
            await asyncio.wait_for(engine.shutdown(), timeout=10)  # its files in /dev/shm go with it
        finally:
            os._exit(1)
