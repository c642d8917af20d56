"""GatewayService: what every gateway route does, without HTTP framing and without Ray.

Built once per gateway replica (``rlgate.actors.gateway.Gateway``) from the run's
settings, the model's tokenizer and the clients of :mod:`rlgate.serving.clients`;
:func:`rlgate.serving.routes.build_app` puts it behind FastAPI routes. Owns the
tokenizer, the chat renderer and the tool-call parser; nothing durable.

Token-in, token-out: prompts are rendered to ids here, the engine returns ids,
and the ids are recorded as they were, with their logprobs and versions.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.completion_choice import Logprobs

from rlgate.background import keep, to_its_end
from rlgate.config import RLGateConfig
from rlgate.rollout.engines import SamplingParams
from rlgate.serving import api
from rlgate.serving.auth import Auth, bearer
from rlgate.serving.chat import ChatRenderer, exchange_keys
from rlgate.serving.errors import HTTPError, error_response
from rlgate.serving.openai_format import TokenText, visible_text
from rlgate.serving.reasoning import ReasoningParser
from rlgate.serving.responses import ResponseLog
from rlgate.serving.toolcalls import detect_parser, get_parser, json_format, structural_tag
from rlgate.serving.turns import Turn, TurnStream, chain, choice_id
from rlgate.sessions.manager import hash_key, new_session_key
from rlgate.sessions.trajectory import Interaction

# A prompt longer than this (characters) is rendered and tokenised in a worker
# thread, so one large request (up to [gateway] max_body_bytes) never stalls
# every other request this process serves; shorter ones stay on the event loop,
# where a thread hop would cost more than the work.
OFF_LOOP_CHARS = 32_768


def prompt_chars(messages: list[dict], tools: list[dict] | None, request: api.ChatCompletionRequest) -> int:
    """About how many characters rendering the prompt will tokenise: every
    message's text, tool-call arguments and reasoning, and the tools."""
    total = sum(len(m["content"] or "") for m in messages)
    for message in request.messages:
        total += len(message.reasoning_content or message.reasoning or "")
        total += sum(len(str(call.function.arguments)) for call in message.tool_calls or ())
    return total + (len(json.dumps(tools)) if tools else 0)


if TYPE_CHECKING:  # the Ray-backed clients; tests may hand in any object with their methods
    from rlgate.serving.clients import EngineClient, JobsClient, Peers, SessionClient, StoreClient


class GatewayService:
    def __init__(
        self,
        settings: RLGateConfig,
        tokenizer,
        auth: Auth,
        sessions: SessionClient,
        engine: EngineClient,
        stores: StoreClient,
        jobs: JobsClient,
        peers: Peers | None = None,
    ) -> None:
        """``peers``: with colocated replicas, how to reach the owner of another slot."""
        self.settings, self.tokenizer, self.auth, self.peers = settings, tokenizer, auth, peers
        self.sessions, self.engine, self.stores, self.jobs = sessions, engine, stores, jobs
        gateway = settings.gateway
        self.renderer = ChatRenderer(tokenizer) if tokenizer.chat_template else None
        self.text_of = TokenText(tokenizer)
        # one thread: large prompts wait for each other there, not for the event loop
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="rlgate-tokenize")
        parser = gateway.tool_parser
        if parser == "auto":
            parser = detect_parser(tokenizer.chat_template)
        self.tool_parser = get_parser(parser, tokenizer) if parser not in (None, "none") else None
        self.reasoning = ReasoningParser(gateway.reasoning_parser, tokenizer) if gateway.reasoning_parser else None
        # Parsers' markers the tokenizer marks special: kept in the text they read (other special tokens are not).
        markers = set(getattr(self.tool_parser, "markers", ())) | set(getattr(self.reasoning, "markers", ()))
        special = dict(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids))
        self.kept_special = frozenset(special[m] for m in markers if m in special)
        self.model_names = [settings.served_model_name, *gateway.model_aliases, "default"]
        self.responses = ResponseLog(gateway.responses_kept)  # for /v1/responses' previous_response_id

    # --- health and status ---------------------------------------------------

    async def health(self):
        try:
            engine = await asyncio.wait_for(self.engine.health(), timeout=10)
        except Exception as err:  # any failure to answer means not ready
            return error_response(503, f"rollout engine not ready: {err.__class__.__name__}")
        return {"status": "ok", "workers": self.settings.rollout.replicas, "policy_version": engine["version"]}

    async def status(self, authorization: str | None) -> dict:
        self.auth.admin(authorization)
        sessions = await self._session_stats()  # first: each session owner gives back the slots it leased
        capacity, trajectories, engine = await asyncio.gather(
            self.stores.capacity_stats(), self.stores.trajectory_stats(), self.engine.health()
        )
        return {
            "status": "ok",
            "workers": self.settings.rollout.replicas,
            "policy_version": engine["version"],
            "engine": engine,
            "sessions": sessions,
            "capacity": capacity,
            "trajectories": trajectories,
        }

    async def _session_stats(self) -> dict:
        own = await self.sessions.stats()
        return own if self.peers is None else await self.peers.session_stats(own)

    # --- session routes (AReaL-compatible) -----------------------------------

    async def start_session(
        self, body: api.StartSessionRequest, base_url: str, authorization: str | None, forwarded: bool = False
    ) -> api.StartSessionResponse:
        """``forwarded``: sent here by another replica for its owner; if this is not
        the owner either (it was away: the router gave up waiting), 421, not forwarded again."""
        self.auth.admin(authorization)
        slot = self.auth.slot
        if body.api_key is not None:
            if self.auth.is_admin(body.api_key):
                raise HTTPError(400, "api_key must be a session key, not the admin key", param="api_key")
            owner = slot.owner(body.api_key) if slot is not None else None
            if owner is not None and forwarded:
                slot.check(body.api_key)  # 421: its owner is away
            if owner is not None and self.peers is not None:  # a refresh belongs with the key's sessions
                return await self.peers.start_session(owner, body, base_url, authorization)
            key, refresh = body.api_key, hash_key(body.api_key)
            self.responses.forget(refresh)  # the next episode does not continue the last one's responses
        else:
            key, refresh = new_session_key(None if slot is None else slot.index), None
        follow_template = (body.reasoning_history or self.settings.gateway.reasoning_history) == "template"
        starting = self.sessions.start(
            body.task_id, hash_key(key), refresh, body.group_size, body.wait_s, body.train, follow_template
        )
        # the caller may hang up while it waits: a (new) session that opens after all has no agent
        unclaimed = (lambda started: self._end_unclaimed(started, hash_key(key))) if refresh is None else None
        session_id = await to_its_end(starting, "a session's start", unclaimed)
        base = self.settings.gateway.public_url or base_url
        inference_url = f"{base.rstrip('/')}/s/{key}/v1"
        return api.StartSessionResponse(session_id=session_id, api_key=key, inference_url=inference_url)

    def _end_unclaimed(self, started: asyncio.Future, key_hash: str) -> None:
        """End, with nothing saved, a session that opened for a caller that had left
        (its key never reached anyone): its slot is free now, not after the idle timeout."""
        if started.cancelled() or started.exception() is not None:
            return

        keep(self.sessions.end(key_hash, False), "ending a session whose caller left")  # if not: the idle sweep

    async def set_reward(self, body: api.SetRewardRequest, authorization: str | None) -> api.SetRewardResponse:
        key_hash = self.auth.session_key(authorization)
        interaction_id = await self.sessions.set_reward(key_hash, body.reward, body.interaction_id, body.turn_rewards)
        return api.SetRewardResponse(message="reward set", interaction_id=interaction_id)

    async def end_session(
        self, body: api.EndSessionRequest | None, authorization: str | None
    ) -> api.EndSessionResponse:
        key_hash = self.auth.session_key(authorization)
        failed = body is not None and body.failed
        count = await self.sessions.end(key_hash, failed)
        self.responses.forget(key_hash)
        message = (
            "session ended as failed; nothing of it is trained on" if failed else "session ended; trajectory saved"
        )
        return api.EndSessionResponse(message=message, interaction_count=count)

    async def trajectories(self, since: int, limit: int, authorization: str | None) -> str:
        """Records with seq > ``since`` as NDJSON."""
        self.auth.admin(authorization)
        records = await self.stores.read(since, limit)
        return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)

    # --- RL jobs (synth-ai compatible) ---------------------------------------
    # The admin key reaches every job; a job's own key (returned at creation)
    # reaches that job only, and cannot list or create jobs.

    async def job(self, method: str, *args, retry: bool = True):
        if self.settings.gateway.route_prefix != "/":
            raise HTTPError(404, "RL jobs are served by the cluster's main gateway, not by a run's own")
        return await self.jobs.call(method, *args, retry=retry)

    # --- OpenAI routes -------------------------------------------------------

    async def models(self, authorization: str | None) -> dict:
        key = bearer(authorization)
        if not self.auth.is_admin(key):  # a live session's key or the admin's, like every other OpenAI route
            await self.sessions.check(hash_key(key))
        created = int(time.time())
        return {
            "object": "list",
            "data": [
                Model(id=name, created=created, object="model", owned_by="rlgate") for name in self.model_names[:-1]
            ],
        }

    def _check_model(self, name: str) -> None:
        if self.settings.gateway.strict_model and name not in self.model_names:
            raise HTTPError(404, f"model {name!r} is not served here; use one of {self.model_names}", param="model")

    def _check_request(self, request: api._Sampling) -> None:
        problems = api.unsupported_fields(request)
        if problems:
            raise HTTPError(400, "; ".join(message for _, message in problems), param=problems[0][0])
        self._check_model(request.model)

    def _sampling(self, request: api._Sampling, max_tokens: int | None, top_logprobs: int) -> SamplingParams:
        gateway = self.settings.gateway
        if request.n > gateway.max_n:  # before SamplingParams, whose own bound would be a 500
            raise HTTPError(400, f"n={request.n} exceeds this gateway's limit of {gateway.max_n}", param="n")
        limit = gateway.max_completion_tokens
        if max_tokens is not None and max_tokens > limit:
            raise HTTPError(400, f"max_tokens={max_tokens} exceeds this gateway's limit of {limit}", param="max_tokens")
        return SamplingParams(
            max_tokens=max_tokens or limit,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            stop=tuple(request.stop or ()),
            seed=request.seed,
            n=request.n,
            top_logprobs=top_logprobs,
            ignore_eos=request.ignore_eos,
        )

    async def _off_loop_if_large(self, chars: int, work, *args):
        """``work(*args)``, in the tokenising thread when it reads more than ``OFF_LOOP_CHARS``."""
        if chars <= OFF_LOOP_CHARS:
            return work(*args)
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, work, *args)

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        context = self.settings.rollout.max_model_len
        if len(prompt_ids) >= context:
            raise HTTPError(
                400, f"the prompt has {len(prompt_ids)} tokens; the model's context holds {context}", param="messages"
            )

    @staticmethod
    async def _started(chunks: AsyncIterator):
        """The engine's ``chunks``, once it has produced the first: a refusal before
        that (saturated, down) is still a status code."""
        try:
            return chain([await anext(chunks)], chunks)
        except StopAsyncIteration:
            return chain([], chunks)

    def _constraint(self, request: api.ChatCompletionRequest, tools: list[dict] | None) -> tuple[str, str] | None:
        """What the output is held to, as the engine's ``SamplingParams.structured``:
        calls in the model's own tool-call format for a forced ``tool_choice``, JSON
        for ``response_format``; None for free text."""
        form = request.response_format
        if request.forces_tool_call:
            choice = request.tool_choice
            name = None if choice == "required" else choice.function.name
            if not tools:
                raise HTTPError(400, "a forced 'tool_choice' needs 'tools'", param="tool_choice")
            if name is not None and name not in [t["function"]["name"] for t in tools]:
                raise HTTPError(400, f"'tool_choice' names {name!r}, which is not in 'tools'", param="tool_choice")
            if form is not None and form.type != "text":
                raise HTTPError(
                    400, "'response_format' cannot be combined with a forced 'tool_choice'", param="response_format"
                )
            if self.tool_parser is None or self.tool_parser.forced is None:
                raise HTTPError(
                    400,
                    "forcing a tool call needs a tool-call format rlgate can constrain ([gateway] tool_parser hermes)",
                    param="tool_choice",
                )
            one = name is not None or request.parallel_tool_calls is False
            return "structural_tag", self.tool_parser.forced(tools, name, one)
        if form is None or form.type == "text":
            return None
        schema = form.json_schema.json_schema if form.type == "json_schema" else {"type": "object"}
        return "structural_tag", structural_tag(json_format(schema))

    def _prompt(self, request: api.ChatCompletionRequest, messages, tools, keys, parent):
        """(prompt ids, the interaction they continue or None): the earlier ids
        verbatim when the request continues ``parent`` (its thinking is in them:
        the renders are compared without it), else rendered afresh, with earlier
        thinking as the template shows it."""
        template_kwargs = request.chat_template_kwargs
        try:
            if parent is not None:
                prompt_ids = self.renderer.continuation_ids(
                    messages, tools, keys.index(parent.key), parent.sequence, parent.last_token, template_kwargs
                )
                if prompt_ids is not None:
                    return prompt_ids, parent.interaction_id
            if any(m.reasoning_content is not None or m.reasoning is not None for m in request.messages):
                messages = [m.for_template(reasoning=True) for m in request.messages]
            return self.renderer.prompt_ids(messages, tools, template_kwargs), None
        except Exception as err:  # the model's own template refused these messages
            raise HTTPError(400, f"the chat template cannot render these messages: {err}", param="messages") from None

    async def chat(
        self, request: api.ChatCompletionRequest, authorization: str | None, frame=None, id_prefix: str = "chatcmpl-"
    ):
        """A ChatCompletion, or for ``stream`` the server-sent events that make one:
        OpenAI's, or ``frame(turn, params, chunks)``'s for another protocol (whose
        answer ids start with ``id_prefix``)."""
        key_hash = self.auth.session_key(authorization)
        if self.renderer is None:
            raise HTTPError(400, "this model has no chat template; use /v1/completions")
        if len(request.messages) > self.settings.gateway.max_messages:
            raise HTTPError(
                400,
                f"{len(request.messages)} messages exceed the limit of {self.settings.gateway.max_messages}",
                param="messages",
            )
        messages = [m.for_template() for m in request.messages]
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        top = (request.top_logprobs or 0) if request.logprobs else 0
        params = self._sampling(request, request.max_completion_tokens or request.max_tokens, top)
        keys = exchange_keys(messages, tools)
        candidates = [keys[i] for i, m in enumerate(messages) if m["role"] == "assistant"]
        session_id, parent = await self.sessions.begin(key_hash, candidates)
        turn, streaming = None, False
        try:  # from here the request is in flight in its session until recorded or abandoned
            self._check_request(request)  # after the key is known good: its errors name the served models
            structured = self._constraint(request, tools)
            if structured is not None:
                params = params.model_copy(update={"structured": structured})
            prompt_ids, parent_id = await self._off_loop_if_large(
                prompt_chars(messages, tools, request), self._prompt, request, messages, tools, keys, parent
            )
            self._check_prompt(prompt_ids)
            parsed_for = tools if self.tool_parser is not None and request.tool_choice != "none" else None
            turn = Turn(self, request, params, session_id, prompt_ids, parent_id, keys[-1], parsed_for, id_prefix)
            if request.stream:
                chunks = self.engine.stream(prompt_ids, params)
                started = await self._started(chunks)
                streaming = True  # the stream owns the turn now
                events = (frame or Turn.stream)(turn, params, started)
                return TurnStream(turn, events, chunks)
            return await turn.complete(params)
        finally:
            if not streaming and (turn is None or not turn.settled):
                self.sessions.abandon(session_id)

    async def completions(self, request: api.CompletionRequest, authorization: str | None) -> Completion:
        key_hash = self.auth.session_key(authorization)
        if isinstance(request.prompt, str):
            prompt_ids = await self._off_loop_if_large(len(request.prompt), self.tokenizer.encode, request.prompt)
        else:
            prompt_ids = list(request.prompt)
            if any(not 0 <= t < len(self.tokenizer) for t in prompt_ids):
                raise HTTPError(400, f"prompt token ids must be in [0, {len(self.tokenizer)})", param="prompt")
        if not prompt_ids:
            raise HTTPError(400, "the prompt is empty", param="prompt")
        self._check_prompt(prompt_ids)
        if request.stream:
            raise HTTPError(400, "'stream' is supported on /v1/chat/completions only", param="stream")
        session_id, _ = await self.sessions.begin(key_hash, [])
        try:
            self._check_request(request)  # after the key is known good: its errors name the served models
            params = self._sampling(request, request.max_tokens, request.logprobs or 0)
            completions = await self.engine.generate_all(prompt_ids, params)
        except BaseException:
            self.sessions.abandon(session_id)
            raise
        completion_id = "cmpl-" + secrets.token_hex(12)
        interactions = [
            Interaction(
                id=choice_id(completion_id, c.index),
                prompt_ids=prompt_ids,
                completion_ids=c.token_ids,
                logprobs=c.logprobs,
                versions=c.versions,
                finish_reason=c.finish_reason,
                temperature=params.temperature,
                adapter=c.adapter,
            )
            for c in completions
        ]
        await self.sessions.record(session_id, interactions)
        choices = []
        for c in completions:
            logprobs = None
            if request.logprobs is not None:
                tokens = [self.text_of(t) for t in c.token_ids]
                offsets, at = [], 0
                for token in tokens:
                    offsets.append(at)
                    at += len(token)
                logprobs = Logprobs(
                    tokens=tokens,
                    token_logprobs=c.logprobs,
                    text_offset=offsets,
                    top_logprobs=[{self.text_of(t): lp for t, lp in d.items()} for d in c.top_logprobs]
                    if c.top_logprobs
                    else None,
                )
            choices.append(
                CompletionChoice(
                    index=c.index,
                    text=visible_text(self.tokenizer, c.token_ids, c.stop_reason),
                    finish_reason=c.finish_reason,
                    logprobs=logprobs,
                )
            )
        generated = sum(len(c.token_ids) for c in completions)
        return Completion(
            id=completion_id,
            object="text_completion",
            created=int(time.time()),
            model=self.settings.served_model_name,
            choices=choices,
            usage=CompletionUsage(
                prompt_tokens=len(prompt_ids), completion_tokens=generated, total_tokens=len(prompt_ids) + generated
            ),
        )
