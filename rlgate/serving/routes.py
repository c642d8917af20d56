"""The gateway's HTTP API: FastAPI routes over a :class:`GatewayService`.

:func:`build_app` makes the ASGI app a gateway replica serves (``rlgate.actors.gateway``
hands it to Ray Serve) and that tests can call directly. Routes only frame:
they read the request, call the service and return its answer.

Only ``/health`` answers without a key: the OpenAPI document is an admin
route, and the interactive pages are off.
"""

from __future__ import annotations

from fastapi import FastAPI, Header, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rlgate.jobs import schema as jobs
from rlgate.serving import anthropic, api, responses
from rlgate.serving.errors import install_error_handlers
from rlgate.serving.middleware import install_middleware
from rlgate.serving.service import GatewayService
from rlgate.telemetry import Metrics


class ClosingStream(StreamingResponse):
    """A streaming response that closes its body however it ends: sent whole, the
    client gone mid-stream, or gone before the first chunk (when Starlette never
    starts the body, and would not close it)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def build_app(service: GatewayService, metrics: Metrics | None = None) -> FastAPI:
    gateway = service.settings.gateway
    app = FastAPI(
        title="rlgate gateway",
        description="OpenAI-compatible session gateway for online RL.",
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    install_error_handlers(app)
    install_middleware(app, gateway.max_body_bytes, metrics, gateway.access_log)

    # --- health and status ---------------------------------------------------

    @app.get("/health")
    async def health():
        return await service.health()

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(authorization: str | None = Header(None)):
        service.auth.admin(authorization)
        return app.openapi()

    @app.get("/rl/status")
    async def status(authorization: str | None = Header(None)):
        return await service.status(authorization)

    # --- session routes (AReaL-compatible) -----------------------------------

    @app.post("/rl/start_session", response_model=api.StartSessionResponse)
    async def start_session(body: api.StartSessionRequest, raw: Request, authorization: str | None = Header(None)):
        return await service.start_session(body, str(raw.base_url), authorization)

    @app.post("/rl/set_reward", response_model=api.SetRewardResponse)
    async def set_reward(body: api.SetRewardRequest, authorization: str | None = Header(None)):
        return await service.set_reward(body, authorization)

    @app.post("/rl/end_session", response_model=api.EndSessionResponse)
    async def end_session(body: api.EndSessionRequest | None = None, authorization: str | None = Header(None)):
        return await service.end_session(body, authorization)

    @app.get("/rl/trajectories")
    async def trajectories(
        since: int = Query(0, ge=0, description="Return records with seq > since."),
        limit: int = Query(1000, ge=1, le=100_000),
        authorization: str | None = Header(None),
    ):
        body = await service.trajectories(since, limit, authorization)
        return StreamingResponse(iter([body]), media_type="application/x-ndjson")

    # --- RL jobs (synth-ai compatible) ---------------------------------------

    @app.post("/api/rl/jobs", response_model=jobs.JobCreated)
    async def create_job(
        body: jobs.JobRequest,
        authorization: str | None = Header(None),
        idempotency_key: str | None = Header(None, max_length=256),
    ):
        service.auth.admin(authorization)
        # a submission without an idempotency key is not retried: it might have been made
        request = body.model_dump(exclude_unset=True)
        return await service.job("submit", request, idempotency_key, retry=bool(idempotency_key))

    @app.get("/api/rl/jobs", response_model=list[jobs.Job])
    async def list_jobs(authorization: str | None = Header(None)):
        service.auth.admin(authorization)
        return await service.job("list")

    @app.get("/api/rl/jobs/{job_id}", response_model=jobs.Job)
    async def get_job(job_id: str, authorization: str | None = Header(None)):
        return await service.job("get", job_id, service.auth.job_caller(authorization))

    @app.get("/api/rl/jobs/{job_id}/events", response_model=list[jobs.Event])
    async def job_events(
        job_id: str,
        since_seq: int = Query(0, ge=0),
        limit: int = Query(200, ge=1, le=10_000),
        authorization: str | None = Header(None),
    ):
        return await service.job("get_events", job_id, service.auth.job_caller(authorization), since_seq, limit)

    @app.get("/api/rl/jobs/{job_id}/metrics")
    async def job_metrics(job_id: str, after_step: int = Query(0, ge=-1), authorization: str | None = Header(None)):
        # -1 (what synth-ai's SDK sends by default) and 0 both mean every point: steps count from 1
        caller = service.auth.job_caller(authorization)
        return {"points": await service.job("get_metrics", job_id, caller, after_step)}

    @app.post("/api/rl/jobs/{job_id}/cancel", response_model=jobs.Job)
    async def cancel_job(job_id: str, authorization: str | None = Header(None)):
        return await service.job("cancel", job_id, service.auth.job_caller(authorization))

    # --- OpenAI routes -------------------------------------------------------

    async def chat(request: api.ChatCompletionRequest, authorization: str | None):
        answer = await service.chat(request, authorization)
        if request.stream:
            return ClosingStream(answer, media_type="text/event-stream")
        # serialised by pydantic in one call: FastAPI's jsonable_encoder walks the model in Python
        return Response(answer.model_dump_json(), media_type="application/json")

    @app.get("/v1/models")
    @app.get("/models")
    async def models(authorization: str | None = Header(None)):
        return await service.models(authorization)

    @app.post("/v1/chat/completions")
    @app.post("/chat/completions")
    async def chat_completions(request: api.ChatCompletionRequest, authorization: str | None = Header(None)):
        return await chat(request, authorization)

    @app.post("/v1/completions")
    @app.post("/completions")
    async def completions(request: api.CompletionRequest, authorization: str | None = Header(None)):
        return await service.completions(request, authorization)

    # --- Anthropic Messages -------------------------------------------------------
    # The same session keys, as `x-api-key` (the anthropic SDK's api_key) or a bearer
    # token (its auth_token); served as a chat completion in Anthropic's framing.

    async def messages_turn(request: anthropic.MessagesRequest, authorization: str | None):
        chat_request = anthropic.to_chat(request)
        answer = await service.chat(chat_request, authorization, frame=anthropic.stream, id_prefix=anthropic.ID_PREFIX)
        if request.stream:
            return ClosingStream(answer, media_type="text/event-stream")
        return Response(anthropic.to_message(answer).model_dump_json(), media_type="application/json")

    @app.post("/v1/messages")
    async def messages(
        request: anthropic.MessagesRequest,
        authorization: str | None = Header(None),
        x_api_key: str | None = Header(None),
    ):
        return await messages_turn(request, authorization or (f"Bearer {x_api_key}" if x_api_key else None))

    # --- OpenAI Responses ---------------------------------------------------------

    async def responses_turn(request: responses.ResponsesRequest, authorization: str | None):
        call = responses.ResponsesCall(request, service.responses, service.auth.session_key(authorization))
        answer = await service.chat(call.chat, authorization, frame=call.stream, id_prefix=responses.ID_PREFIX)
        if request.stream:
            return ClosingStream(answer, media_type="text/event-stream")
        return JSONResponse(call.response(answer))

    @app.post("/v1/responses")
    @app.post("/responses")
    async def create_response(request: responses.ResponsesRequest, authorization: str | None = Header(None)):
        return await responses_turn(request, authorization)

    # --- the session-scoped inference URL ----------------------------------------
    # start_session hands out `{gateway}/s/{session key}/v1`: the path is the
    # credential, so a task app given it as its inference_url needs no key of
    # ours (any Authorization header it sends is ignored) and reaches no other session.

    @app.get("/s/{session_key}/v1/models")
    @app.get("/s/{session_key}/models")
    async def scoped_models(session_key: str):
        service.auth.session_key(f"Bearer {session_key}")  # the admin key never goes in a URL (400)
        return await service.models(f"Bearer {session_key}")

    @app.post("/s/{session_key}/v1/chat/completions")
    @app.post("/s/{session_key}/chat/completions")
    async def scoped_chat_completions(session_key: str, request: api.ChatCompletionRequest):
        return await chat(request, f"Bearer {session_key}")

    @app.post("/s/{session_key}/v1/messages")
    async def scoped_messages(session_key: str, request: anthropic.MessagesRequest):
        return await messages_turn(request, f"Bearer {session_key}")

    @app.post("/s/{session_key}/v1/responses")
    @app.post("/s/{session_key}/responses")
    async def scoped_responses(session_key: str, request: responses.ResponsesRequest):
        return await responses_turn(request, f"Bearer {session_key}")

    @app.post("/s/{session_key}/v1/completions")
    @app.post("/s/{session_key}/completions")
    async def scoped_completions(session_key: str, request: api.CompletionRequest):
        return await service.completions(request, f"Bearer {session_key}")

    return app
