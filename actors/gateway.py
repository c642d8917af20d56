"""Gateway: the HTTP API (FastAPI ingress on Ray Serve), stateless and scalable.

Created by ``serve_app.build_app`` in front of the RolloutServer deployment.
Called by agents (OpenAI routes with a session key), operators (session
routes and status with the admin key) and task apps. On start it gets or
creates the run's named actors (CapacityActor, TrajectoryStore, SessionStore).
Owns nothing durable: a tokenizer and chat renderer, and handles.

Token-in, token-out: prompts are rendered to ids here, the engine returns ids,
and the ids are recorded as they were, with their logprobs and versions.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall, ChoiceDeltaToolCallFunction
from openai.types.chat.chat_completion_chunk import ChoiceLogprobs as ChunkLogprobs
from openai.types.chat.chat_completion_message_tool_call import ChatCompletionMessageToolCall, Function
from openai.types.completion_choice import Logprobs
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.capacity import get_or_create_capacity
from actors.job_manager import get_or_create_job_manager
from actors.session_store import SessionStore
from actors.trajectory_store import TrajectoryStore
from rlgate import api, jobs
from rlgate.chat import ChatRenderer, exchange_keys, extend_key
from rlgate.config import RLGateConfig
from rlgate.engines import SamplingParams
from rlgate.engines.base import EngineInputError
from rlgate.openai_format import TextStream, TokenText, chat_logprobs, visible_text
from rlgate.sessions import SessionError, hash_key, new_session_key, same_secret
from rlgate.telemetry import Metrics
from rlgate.toolcalls import detect_parser, get_parser
from rlgate.trajectory import Interaction

NAMESPACE = "rlgate"
# Only /health answers without a key: the OpenAPI document is an admin route
# (below), and the interactive pages are off.
app = FastAPI(
    title="rlgate gateway",
    description="OpenAI-compatible session gateway for online RL.",
    openapi_url=None,
    docs_url=None,
    redoc_url=None,
)


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after = status, message, param, retry_after


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    410: "gone_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def error_response(status: int, message: str, param: str | None = None, retry_after: float | None = None):
    """OpenAI's error shape, so SDKs raise the right exception with our message."""
    body = {
        "error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param, "code": status}
    }
    headers = {"Retry-After": str(int(retry_after + 0.999))} if retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


@app.exception_handler(HTTPError)
async def _http_error(_, err: HTTPError):
    return error_response(err.status, err.message, err.param, err.retry_after)


@app.exception_handler(StarletteHTTPException)
async def _no_route(_, err: StarletteHTTPException):
    """No such route (404) or method (405), in the same error shape as everything else."""
    message = {404: "no such route", 405: "method not allowed on this route"}.get(err.status_code, str(err.detail))
    return error_response(err.status_code, message)


@app.exception_handler(SessionError)
async def _session_error(_, err: SessionError):
    return error_response(err.status, err.message, retry_after=err.retry_after)


@app.exception_handler(RequestValidationError)
async def _validation_error(_, err: RequestValidationError):
    first = err.errors()[0]
    where = ".".join(str(part) for part in first["loc"] if part != "body")
    if first["type"] == "json_invalid":
        return error_response(422, f"the body is not valid JSON: {first['msg']}")
    return error_response(422, f"{where or 'body'}: {first['msg']}", param=where or None)


class _BodyLimit:
    """413 for a body over ``[gateway] max_body_bytes``: at once when its
    Content-Length says so, else (a chunked body) as soon as that much has arrived."""

    def __init__(self, asgi) -> None:
        self.asgi = asgi

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.asgi(scope, receive, send)
        limit = scope["app"].state.max_body_bytes  # the app Serve runs (a copy of the module's)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            too_big = error_response(413, f"request body of {int(declared)} bytes exceeds the {limit}-byte limit")
            return await too_big(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:  # FastAPI passes HTTP exceptions raised while reading the body through
                raise StarletteHTTPException(413, f"request body exceeds the {limit}-byte limit")
            return message

        return await self.asgi(scope, counted, send)


app.add_middleware(_BodyLimit)


app.state.max_body_bytes = 4 * 2**20
app.state.access_log = False  # [gateway] access_log, set by Gateway.__init__
access_log = logging.getLogger("ray.serve")  # into the replica's log, beside Serve's own lines
app.state.metrics = None  # the replica's rlgate.telemetry.Metrics, set by Gateway.__init__


class _Measure:
    """Requests and latency (to the first byte) per route template: a scoped URL's key stays out.

    Pure ASGI: Starlette's ``BaseHTTPMiddleware`` runs every request through a
    task group and memory streams, which cost more CPU than a tiny engine step."""

    def __init__(self, asgi) -> None:
        self.asgi = asgi

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.asgi(scope, receive, send)
        started = time.monotonic()
        state = scope["app"].state  # the app Serve runs (a copy of the module's)

        async def measured(message):
            if message["type"] == "http.response.start":
                _measured(state, scope, message["status"], time.monotonic() - started)
            await send(message)

        return await self.asgi(scope, receive, measured)


def _measured(state, scope, status: int, elapsed: float) -> None:
    route = getattr(scope.get("route"), "path", "unmatched")
    # Serve's own access log is off for the Gateway: it logs raw paths, and a scoped URL's path holds a key.
    if state.access_log:
        access_log.info("%s %s %d %.1fms", scope["method"], route, status, elapsed * 1000)
    if state.metrics is not None:
        state.metrics.inc("rlgate_requests_total", route=route, status=str(status))
        state.metrics.observe("rlgate_request_seconds", elapsed, route=route)


app.add_middleware(_Measure)  # outermost: it also sees the body limit's 413s


def _cause(err: BaseException) -> BaseException:
    return err.cause if isinstance(err, RayTaskError) else err


def _bearer(authorization: str | None) -> str:
    if not authorization:
        raise HTTPError(401, "missing API key: send the header 'Authorization: Bearer <key>'")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise HTTPError(401, "malformed Authorization header: expected 'Bearer <key>'")
    return token.strip()


class _ServiceDown(HTTPError):
    """An actor behind a route died (Ray may be restarting it)."""


# Helpers used by the Gateway's methods are defined before the class: Serve's
# ingress decorator serialises the class as soon as it is defined.


async def _chain(first: list, rest: AsyncIterator) -> AsyncIterator:
    for item in first:
        yield item
    async for item in rest:
        yield item


def _choice_id(completion_id: str, index: int) -> str:
    """The interaction id of a choice: the completion id for the first (so
    ``set_reward(interaction_id=completion.id)`` works), suffixed for others."""
    return completion_id if index == 0 else f"{completion_id}-{index}"


class _Turn:
    """One chat completion request: generate, shape the answer, record the interactions."""

    def __init__(self, gateway: Gateway, request, params, session_id, prompt_ids, parent_id, messages_key, use_tools):
        self.g, self.request, self.params = gateway, request, params
        self.session_id, self.prompt_ids, self.parent_id = session_id, prompt_ids, parent_id
        self.messages_key, self.use_tools = messages_key, use_tools
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.recorded = False

    def _answer(self, text: str):
        """(content, tool calls) as returned to the client."""
        if not self.use_tools:
            return text, []
        parsed = self.g.tool_parser.parse(text)
        return parsed.content, parsed.tool_calls

    def _interaction(self, completion, content, calls) -> Interaction:
        message = {
            "role": "assistant",
            "content": content,
            "tool_calls": [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls],
        }
        return Interaction(
            id=_choice_id(self.id, completion.index),
            prompt_ids=self.prompt_ids,
            completion_ids=completion.token_ids,
            logprobs=completion.logprobs,
            versions=completion.versions,
            finish_reason=completion.finish_reason,
            parent=self.parent_id,
            key=extend_key(self.messages_key, message),
            temperature=self.params.temperature,  # as sampled (after the engines' floors)
        )

    def _finish_reason(self, completion, calls) -> str:
        if calls:
            return "tool_calls"
        return "length" if completion.finish_reason == "length" else "stop"

    async def complete(self, params: SamplingParams) -> ChatCompletion:
        completions = await self.g._generate_all(self.prompt_ids, params)
        choices, interactions = [], []
        for c in completions:
            content, calls = self._answer(visible_text(self.g.tokenizer, c.token_ids, c.stop_reason))
            interactions.append(self._interaction(c, content, calls))
            logprobs = None
            if self.request.logprobs:
                logprobs = ChoiceLogprobs(
                    content=chat_logprobs(self.g.text_of, c.token_ids, c.logprobs, c.top_logprobs)
                )
            message = ChatCompletionMessage(
                role="assistant",
                content=content,
                tool_calls=[
                    ChatCompletionMessageToolCall(
                        id=t.id, type="function", function=Function(name=t.name, arguments=t.arguments)
                    )
                    for t in calls
                ]
                or None,
            )
            choices.append(
                Choice(index=c.index, message=message, finish_reason=self._finish_reason(c, calls), logprobs=logprobs)
            )
        await self.g._call(self.g.sessions.record.remote(self.session_id, interactions))
        self.recorded = True
        generated = sum(len(c.token_ids) for c in completions)
        return ChatCompletion(
            id=self.id,
            object="chat.completion",
            created=self.created,
            model=self.g.settings.served_model_name,
            choices=choices,
            usage=CompletionUsage(
                prompt_tokens=len(self.prompt_ids),
                completion_tokens=generated,
                total_tokens=len(self.prompt_ids) + generated,
            ),
        )

    def _chunk(self, choices, usage=None) -> str:
        chunk = ChatCompletionChunk(
            id=self.id,
            object="chat.completion.chunk",
            created=self.created,
            model=self.g.settings.served_model_name,
            choices=choices,
            usage=usage,
        )
        return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"

    async def stream(self, params: SamplingParams, chunks: AsyncIterator) -> AsyncIterator[str]:
        """Server-sent events from the engine's ``chunks``: text as tokens arrive, tool
        calls once complete, the interactions recorded before the usage chunk and ``[DONE]``."""
        from rlgate.engines.base import Completion as EngineCompletion

        n = params.n
        texts = [TextStream(self.g.tokenizer, list(params.stop)) for _ in range(n)]
        calls_stream = [self.g.tool_parser.stream() if self.use_tools else None for _ in range(n)]
        done = [EngineCompletion(index=i) for i in range(n)]
        sent = [""] * n  # content already streamed, per choice
        try:
            for i in range(n):
                yield self._chunk([ChunkChoice(index=i, delta=ChoiceDelta(role="assistant", content=""))])
            async for chunk in chunks:
                i = chunk.index
                done[i].add(chunk)
                text = texts[i].push(chunk.token_ids)
                if chunk.finish_reason is not None:
                    text += texts[i].finish(chunk.stop_reason)
                pieces = calls_stream[i].feed(text) if calls_stream[i] else [text]
                logprobs = None
                if self.request.logprobs:
                    logprobs = ChunkLogprobs(
                        content=chat_logprobs(self.g.text_of, chunk.token_ids, chunk.logprobs, chunk.top_logprobs)
                    )
                content = "".join(pieces)
                sent[i] += content
                if content or logprobs:
                    yield self._chunk([ChunkChoice(index=i, delta=ChoiceDelta(content=content), logprobs=logprobs)])
            interactions = []
            for i, completion in enumerate(done):
                if calls_stream[i]:
                    parsed = calls_stream[i].finish()
                    content, calls = parsed.content, parsed.tool_calls
                    rest = (content or "")[len(sent[i]) :]  # text the parser held back until the end
                    if rest:
                        yield self._chunk([ChunkChoice(index=i, delta=ChoiceDelta(content=rest))])
                else:
                    content, calls = visible_text(self.g.tokenizer, completion.token_ids, completion.stop_reason), []
                interactions.append(self._interaction(completion, content, calls))
                if calls:
                    yield self._chunk(
                        [
                            ChunkChoice(
                                index=i,
                                delta=ChoiceDelta(
                                    tool_calls=[
                                        ChoiceDeltaToolCall(
                                            index=k,
                                            id=t.id,
                                            type="function",
                                            function=ChoiceDeltaToolCallFunction(name=t.name, arguments=t.arguments),
                                        )
                                        for k, t in enumerate(calls)
                                    ]
                                ),
                            )
                        ]
                    )
                yield self._chunk(
                    [ChunkChoice(index=i, delta=ChoiceDelta(), finish_reason=self._finish_reason(completion, calls))]
                )
            await self.g._call(self.g.sessions.record.remote(self.session_id, interactions))
            self.recorded = True
            generated = sum(len(c.token_ids) for c in done)
            yield self._chunk(
                [],
                usage=CompletionUsage(
                    prompt_tokens=len(self.prompt_ids),
                    completion_tokens=generated,
                    total_tokens=len(self.prompt_ids) + generated,
                ),
            )
            yield "data: [DONE]\n\n"
        except (HTTPError, SessionError) as err:
            status = err.status
            body = {"error": {"message": err.message, "type": _ERROR_TYPES.get(status, "server_error"), "code": status}}
            yield f"data: {json.dumps(body)}\n\n"
        finally:  # also when the client goes away mid-stream
            if not self.recorded:
                self.g.sessions.abandon.remote(self.session_id)


@serve.deployment(name="Gateway", max_ongoing_requests=2048, health_check_period_s=10)
@serve.ingress(app)
class Gateway:
    def __init__(self, rollout, config: dict, model_path: str, admin_key_hash: str) -> None:
        from transformers import AutoTokenizer

        self.settings = RLGateConfig.model_validate(config)
        gateway = self.settings.gateway
        app.state.max_body_bytes = gateway.max_body_bytes
        app.state.access_log = gateway.access_log
        app.state.metrics = Metrics(gateway.run_name)
        self.rollout = rollout
        self.admin_key_hash = admin_key_hash
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.renderer = ChatRenderer(self.tokenizer) if self.tokenizer.chat_template else None
        self.text_of = TokenText(self.tokenizer)
        parser = gateway.tool_parser
        if parser == "auto":
            parser = detect_parser(self.tokenizer.chat_template)
        self.tool_parser = get_parser(parser) if parser not in (None, "none") else None
        self.model_names = [self.settings.served_model_name, *gateway.model_aliases, "default"]
        run = f"rlgate-{gateway.run_name}"
        self.capacity = get_or_create_capacity(f"{run}-capacity", NAMESPACE, gateway.max_concurrent)
        self.trajectories = TrajectoryStore.options(
            name=f"{run}-trajectories", namespace=NAMESPACE, lifetime="detached", get_if_exists=True
        ).remote(config["gateway"]["run_dir"])
        self.sessions = SessionStore.options(
            name=f"{run}-sessions", namespace=NAMESPACE, lifetime="detached", get_if_exists=True
        ).remote(self.capacity, self.trajectories, gateway.model_dump())
        self._job_manager = None  # made on the first /api/rl/jobs call

    # --- auth ----------------------------------------------------------------

    def _is_admin(self, key: str) -> bool:
        return same_secret(hash_key(key), self.admin_key_hash)

    def _admin(self, authorization: str | None) -> None:
        if not self._is_admin(_bearer(authorization)):
            raise HTTPError(401, "this route needs the admin key")

    def _session_key(self, authorization: str | None) -> str:
        key = _bearer(authorization)
        if self._is_admin(key):
            raise HTTPError(400, "the admin key is not a session key; use the api_key from /rl/start_session")
        return hash_key(key)

    async def _call(self, ref):
        """Await an actor call, turning its SessionError into the HTTP answer."""
        try:
            return await ref
        except RayTaskError as err:
            cause = _cause(err)
            if isinstance(cause, SessionError):
                raise cause from None
            raise
        except RayActorError as err:
            raise _ServiceDown(503, f"session service unavailable: {err.__class__.__name__}; retry") from None

    # --- health and status ---------------------------------------------------

    @app.get("/health")
    async def health(self):
        try:
            engine = await asyncio.wait_for(self.rollout.health.remote(), timeout=10)
        except Exception as err:  # any failure to answer means not ready
            return error_response(503, f"rollout engine not ready: {err.__class__.__name__}")
        return {"status": "ok", "workers": self.settings.rollout.replicas, "policy_version": engine["version"]}

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self, raw: Request, authorization: str | None = Header(None)):
        self._admin(authorization)
        return raw.app.openapi()

    @app.get("/rl/status")
    async def status(self, authorization: str | None = Header(None)):
        self._admin(authorization)
        sessions, capacity, trajectories, engine = await asyncio.gather(
            self.sessions.stats.remote(),
            self.capacity.stats.remote(),
            self.trajectories.stats.remote(),
            self.rollout.health.remote(),
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

    # --- session routes (AReaL-compatible) -----------------------------------

    @app.post("/rl/start_session", response_model=api.StartSessionResponse)
    async def start_session(
        self, body: api.StartSessionRequest, raw: Request, authorization: str | None = Header(None)
    ):
        self._admin(authorization)
        if body.api_key is not None:
            if self._is_admin(body.api_key):
                raise HTTPError(400, "api_key must be a session key, not the admin key", param="api_key")
            key, refresh = body.api_key, hash_key(body.api_key)
        else:
            key, refresh = new_session_key(), None
        session_id = await self._call(
            self.sessions.start.remote(body.task_id, hash_key(key), refresh, body.group_size, body.wait_s, body.train)
        )
        base = self.settings.gateway.public_url or str(raw.base_url)
        inference_url = f"{base.rstrip('/')}/s/{key}/v1"
        return api.StartSessionResponse(session_id=session_id, api_key=key, inference_url=inference_url)

    @app.post("/rl/set_reward", response_model=api.SetRewardResponse)
    async def set_reward(self, body: api.SetRewardRequest, authorization: str | None = Header(None)):
        key_hash = self._session_key(authorization)
        interaction_id = await self._call(
            self.sessions.set_reward.remote(key_hash, body.reward, body.interaction_id, body.turn_rewards)
        )
        return api.SetRewardResponse(message="reward set", interaction_id=interaction_id)

    @app.post("/rl/end_session", response_model=api.EndSessionResponse)
    async def end_session(self, body: api.EndSessionRequest | None = None, authorization: str | None = Header(None)):
        key_hash = self._session_key(authorization)
        failed = body is not None and body.failed
        count = await self._call(self.sessions.end.remote(key_hash, failed))
        message = (
            "session ended as failed; nothing of it is trained on" if failed else "session ended; trajectory saved"
        )
        return api.EndSessionResponse(message=message, interaction_count=count)

    @app.get("/rl/trajectories")
    async def trajectories(
        self,
        since: int = Query(0, ge=0, description="Return records with seq > since."),
        limit: int = Query(1000, ge=1, le=100_000),
        authorization: str | None = Header(None),
    ):
        self._admin(authorization)
        records = await self.trajectories.read.remote(since, limit)
        body = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
        return StreamingResponse(iter([body]), media_type="application/x-ndjson")

    # --- RL jobs (synth-ai compatible) ---------------------------------------
    # The admin key reaches every job; a job's own key (returned at creation)
    # reaches that job only, and cannot list or create jobs.

    @property
    def job_manager(self):
        if self._job_manager is None:
            gateway = self.settings.gateway
            jobs_dir = str(Path(gateway.run_dir).parent / "jobs")
            where = {"host": gateway.host, "port": gateway.port}
            self._job_manager = get_or_create_job_manager(gateway.run_name, jobs_dir, where, gateway.max_running_jobs)
        return self._job_manager

    async def _jobs(self, method: str, *args, retry: bool = True):
        """Call the JobManager; one that died is replaced (it reloads every job from disk) and,
        when ``retry``, asked again."""
        if self.settings.gateway.route_prefix != "/":
            raise HTTPError(404, "RL jobs are served by the cluster's main gateway, not by a run's own")
        try:
            return await self._call(getattr(self.job_manager, method).remote(*args))
        except _ServiceDown:
            self._job_manager = None
            if not retry:
                raise
            return await self._call(getattr(self.job_manager, method).remote(*args))

    def _job_caller(self, authorization: str | None) -> str | None:
        """None for the admin, else the job key the caller sent."""
        key = _bearer(authorization)
        return None if self._is_admin(key) else key

    @app.post("/api/rl/jobs", response_model=jobs.JobCreated)
    async def create_job(
        self,
        body: jobs.JobRequest,
        authorization: str | None = Header(None),
        idempotency_key: str | None = Header(None, max_length=256),
    ):
        self._admin(authorization)
        # a submission without an idempotency key is not retried: it might have been made
        return await self._jobs(
            "submit", body.model_dump(exclude_unset=True), idempotency_key, retry=bool(idempotency_key)
        )

    @app.get("/api/rl/jobs", response_model=list[jobs.Job])
    async def list_jobs(self, authorization: str | None = Header(None)):
        self._admin(authorization)
        return await self._jobs("list")

    @app.get("/api/rl/jobs/{job_id}", response_model=jobs.Job)
    async def get_job(self, job_id: str, authorization: str | None = Header(None)):
        return await self._jobs("get", job_id, self._job_caller(authorization))

    @app.get("/api/rl/jobs/{job_id}/events", response_model=list[jobs.Event])
    async def job_events(
        self,
        job_id: str,
        since_seq: int = Query(0, ge=0),
        limit: int = Query(200, ge=1, le=10_000),
        authorization: str | None = Header(None),
    ):
        caller = self._job_caller(authorization)
        return await self._jobs("get_events", job_id, caller, since_seq, limit)

    @app.get("/api/rl/jobs/{job_id}/metrics")
    async def job_metrics(
        self, job_id: str, after_step: int = Query(0, ge=0), authorization: str | None = Header(None)
    ):
        caller = self._job_caller(authorization)
        return {"points": await self._jobs("get_metrics", job_id, caller, after_step)}

    @app.post("/api/rl/jobs/{job_id}/cancel", response_model=jobs.Job)
    async def cancel_job(self, job_id: str, authorization: str | None = Header(None)):
        return await self._jobs("cancel", job_id, self._job_caller(authorization))

    # --- OpenAI routes -------------------------------------------------------

    @app.get("/v1/models")
    @app.get("/models")
    async def models(self, authorization: str | None = Header(None)):
        key = _bearer(authorization)
        if not self._is_admin(key):  # a live session's key or the admin's, like every other OpenAI route
            await self._call(self.sessions.check.remote(hash_key(key)))
        created = int(time.time())
        return {
            "object": "list",
            "data": [
                Model(id=name, created=created, object="model", owned_by="rlgate") for name in self.model_names[:-1]
            ],
        }

    # --- the session-scoped inference URL ----------------------------------------
    # start_session hands out `{gateway}/s/{session key}/v1`: the path is the
    # credential, so a task app given it as its inference_url needs no key of
    # ours (any Authorization header it sends is ignored) and reaches no other session.

    @app.get("/s/{session_key}/v1/models")
    @app.get("/s/{session_key}/models")
    async def scoped_models(self, session_key: str):
        self._session_key(f"Bearer {session_key}")  # the admin key never goes in a URL (400)
        return await self.models(authorization=f"Bearer {session_key}")

    @app.post("/s/{session_key}/v1/chat/completions")
    @app.post("/s/{session_key}/chat/completions")
    async def scoped_chat_completions(self, session_key: str, request: api.ChatCompletionRequest):
        return await self.chat_completions(request, authorization=f"Bearer {session_key}")

    @app.post("/s/{session_key}/v1/completions")
    @app.post("/s/{session_key}/completions")
    async def scoped_completions(self, session_key: str, request: api.CompletionRequest):
        return await self.completions(request, authorization=f"Bearer {session_key}")

    def _check_model(self, name: str) -> None:
        if self.settings.gateway.strict_model and name not in self.model_names:
            raise HTTPError(404, f"model {name!r} is not served here; use one of {self.model_names}", param="model")

    def _check_request(self, request: api._Sampling) -> None:
        problems = api.unsupported_fields(request)
        if problems:
            raise HTTPError(400, "; ".join(message for _, message in problems), param=problems[0][0])
        self._check_model(request.model)
        gateway = self.settings.gateway
        if request.n > gateway.max_n:
            raise HTTPError(400, f"n={request.n} exceeds this gateway's limit of {gateway.max_n}", param="n")

    def _sampling(self, request: api._Sampling, max_tokens: int | None, top_logprobs: int) -> SamplingParams:
        limit = self.settings.gateway.max_completion_tokens
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

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        context = self.settings.rollout.max_model_len
        if len(prompt_ids) >= context:
            raise HTTPError(
                400, f"the prompt has {len(prompt_ids)} tokens; the model's context holds {context}", param="messages"
            )

    def _engine_error(self, err: BaseException) -> HTTPError:
        """An engine failure as the HTTP answer: bad input 400, anything else 503."""
        if isinstance(err, BackPressureError):
            return HTTPError(
                503,
                "the rollout engines are saturated (every replica busy, the queue full); retry shortly",
                retry_after=1,
            )
        cause = _cause(err)
        if isinstance(cause, EngineInputError):
            return HTTPError(400, str(cause))
        if isinstance(err, RayTaskError):
            return HTTPError(503, f"rollout engine failed: {cause.__class__.__name__}: {cause}")
        return HTTPError(503, f"rollout engine unavailable: {err.__class__.__name__}")

    async def _generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator:
        """Engine chunks as they are produced, for streaming responses."""
        stream = self.rollout.options(stream=True).generate.remote(prompt_ids, params.model_dump())
        try:
            async for chunk in stream:
                yield chunk
        except (RayTaskError, RayActorError, RuntimeError, BackPressureError) as err:
            raise self._engine_error(err) from None

    async def _started(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator:
        """The engine's chunks, once it has produced the first."""
        chunks = self._generate(prompt_ids, params)
        try:
            return _chain([await anext(chunks)], chunks)
        except StopAsyncIteration:
            return _chain([], chunks)

    async def _generate_all(self, prompt_ids: list[int], params: SamplingParams) -> list:
        """Whole completions in one engine reply, for non-streaming responses."""
        try:
            return await self.rollout.generate_all.remote(prompt_ids, params.model_dump())
        except (RayTaskError, RayActorError, RuntimeError, BackPressureError) as err:
            raise self._engine_error(err) from None

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(self, request: api.ChatCompletionRequest, authorization: str | None = Header(None)):
        key_hash = self._session_key(authorization)
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
        session_id, parent = await self._call(self.sessions.begin.remote(key_hash, candidates))
        turn, streaming = None, False
        try:  # from here the request is in flight in its session until recorded or abandoned
            self._check_request(request)  # after the key is known good: its errors name the served models
            prompt_ids = None
            if parent is not None:
                prompt_ids = self.renderer.continuation_ids(
                    messages, tools, keys.index(parent.key), parent.sequence, parent.last_token
                )
            parent_id = parent.interaction_id if parent is not None and prompt_ids is not None else None
            if prompt_ids is None:
                try:
                    prompt_ids = self.renderer.prompt_ids(messages, tools)
                except Exception as err:  # the model's own template refused these messages
                    raise HTTPError(
                        400, f"the chat template cannot render these messages: {err}", param="messages"
                    ) from None
            self._check_prompt(prompt_ids)
            use_tools = self.tool_parser is not None and tools is not None and request.tool_choice != "none"
            turn = _Turn(self, request, params, session_id, prompt_ids, parent_id, keys[-1], use_tools)
            if request.stream:
                # nothing is sent before the engine's first token: a refusal (saturated, down) is a status code
                chunks = await self._started(prompt_ids, params)
                streaming = True  # the stream owns the turn now
                return StreamingResponse(turn.stream(params, chunks), media_type="text/event-stream")
            return await turn.complete(params)
        finally:
            if not streaming and (turn is None or not turn.recorded):
                self.sessions.abandon.remote(session_id)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(self, request: api.CompletionRequest, authorization: str | None = Header(None)):
        key_hash = self._session_key(authorization)
        if isinstance(request.prompt, str):
            prompt_ids = self.tokenizer.encode(request.prompt)
        else:
            prompt_ids = list(request.prompt)
            if any(not 0 <= t < len(self.tokenizer) for t in prompt_ids):
                raise HTTPError(400, f"prompt token ids must be in [0, {len(self.tokenizer)})", param="prompt")
        if not prompt_ids:
            raise HTTPError(400, "the prompt is empty", param="prompt")
        self._check_prompt(prompt_ids)
        if request.stream:
            raise HTTPError(400, "'stream' is supported on /v1/chat/completions only", param="stream")
        session_id, _ = await self._call(self.sessions.begin.remote(key_hash, []))
        try:
            self._check_request(request)  # after the key is known good: its errors name the served models
            params = self._sampling(request, request.max_tokens, request.logprobs or 0)
            completions = await self._generate_all(prompt_ids, params)
        except BaseException:
            self.sessions.abandon.remote(session_id)
            raise
        completion_id = "cmpl-" + secrets.token_hex(12)
        interactions = [
            Interaction(
                id=_choice_id(completion_id, c.index),
                prompt_ids=prompt_ids,
                completion_ids=c.token_ids,
                logprobs=c.logprobs,
                versions=c.versions,
                finish_reason=c.finish_reason,
                temperature=params.temperature,
            )
            for c in completions
        ]
        await self._call(self.sessions.record.remote(session_id, interactions))
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
