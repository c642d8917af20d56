"""Anthropic's Messages API (``POST /v1/messages``) over the chat completion path.

A Messages request is translated to a chat completion request
(:func:`to_chat`) and served as one, so it joins the same session, renders with
the same chat template, continues earlier turns token for token and is recorded
exactly like a chat completion. Only the framing differs: the answer becomes a
``Message`` (:func:`to_message`) or Anthropic's stream events (:func:`stream`).

Translation:

* ``system`` (text or text blocks) -> a leading system message;
* user ``text`` blocks -> a user message; ``tool_result`` blocks -> ``tool``
  messages, before the user's text, in order;
* assistant ``text`` + ``tool_use`` blocks -> an assistant message with
  ``tool_calls`` (``input`` as the call's JSON arguments);
* ``tools`` -> function tools (``input_schema`` as ``parameters``);
  ``tool_choice`` as OpenAI's (``any``: ``required``, ``tool``: that function,
  ``disable_parallel_tool_use``: one call);
* ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, ``max_tokens``
  as sampling parameters.

``cache_control`` is accepted and ignored (the engine caches prefixes
itself), as are ``metadata`` and ``service_tier``. ``temperature``, ``top_p``
and ``top_k`` are honoured though recent SDKs no longer send them (pass them in
``extra_body``). What cannot be honoured -- images, documents, extended
``thinking``, ``output_config`` -- is a 400 (or 422) that names it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any, Literal

from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rlgate.serving import api
from rlgate.serving.errors import HTTPError, anthropic_error_body, broken_stream, invalid_translation
from rlgate.sessions.manager import SessionError

if TYPE_CHECKING:
    from anthropic.types import Message

ID_PREFIX = "msg_"


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cache_control: dict | None = None


class TextIn(_Block):
    type: Literal["text"]
    text: str
    citations: list | None = None


class ToolUseIn(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict
    # as the SDK sends back a reply's ToolUseBlock: who called it (the model, directly) and its toolset
    caller: dict | None = None
    toolset_name: str | None = None

    @model_validator(mode="after")
    def _called_directly(self) -> ToolUseIn:
        if self.caller is not None and self.caller.get("type") != "direct":
            raise ValueError(f"tool_use caller {self.caller.get('type')!r} is not supported (server tools); 'direct'")
        return self


class ToolResultIn(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextIn] = ""
    is_error: bool = False
    toolset_name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(block.text for block in self.content)


Block = Annotated[TextIn | ToolUseIn | ToolResultIn, Field(discriminator="type")]


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data):
        content = data.get("content") if isinstance(data, dict) else None
        if isinstance(content, list):
            for block in content:
                kind = block.get("type") if isinstance(block, dict) else None
                if kind not in ("text", "tool_use", "tool_result"):
                    raise ValueError(f"content blocks of type {kind!r} are not supported (text, tool_use, tool_result)")
        return data


class ToolIn(BaseModel):
    model_config = ConfigDict(extra="allow")  # other fields: a 400 naming them (to_chat)
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None
    cache_control: dict | None = None
    strict: bool | None = Field(None, description="Accepted as chat's function strict is.")
    eager_input_streaming: bool | None = Field(None, description="Accepted; a streamed call's input comes whole.")


class ToolChoiceIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(api._Request):
    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: list[MessageIn] = Field(min_length=1)
    system: str | list[TextIn] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoiceIn | None = None
    metadata: dict | None = Field(None, description="Accepted for compatibility; not used.")
    service_tier: str | None = Field(None, description="Accepted for compatibility; not used.")
    cache_control: dict | None = Field(None, description="Accepted; the engine caches prefixes itself.")
    thinking: dict | None = None


def _messages(request: MessagesRequest) -> list[dict]:
    out: list[dict[str, Any]] = []
    if request.system:
        system = request.system if isinstance(request.system, str) else "".join(b.text for b in request.system)
        out.append({"role": "system", "content": system})
    for i, message in enumerate(request.messages):
        blocks = [TextIn(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        text = "".join(b.text for b in blocks if isinstance(b, TextIn))
        if message.role == "assistant":
            if any(isinstance(b, ToolResultIn) for b in blocks):
                raise HTTPError(400, f"messages.{i}: tool_result blocks belong in user messages", param="messages")
            calls = [api.tool_call(b.id, b.name, json.dumps(b.input)) for b in blocks if isinstance(b, ToolUseIn)]
            out.append({"role": "assistant", "content": text or None, "tool_calls": calls or None})
            continue
        if any(isinstance(b, ToolUseIn) for b in blocks):
            raise HTTPError(400, f"messages.{i}: tool_use blocks belong in assistant messages", param="messages")
        for block in blocks:
            if isinstance(block, ToolResultIn):
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        if text or not any(isinstance(b, ToolResultIn) for b in blocks):
            out.append({"role": "user", "content": text})
    return out


def _tool_choice(choice: ToolChoiceIn | None):
    if choice is None:
        return None, None
    parallel = None if choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use
    if choice.type == "any":
        return "required", parallel
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return choice.type, parallel


def to_chat(request: MessagesRequest) -> api.ChatCompletionRequest:
    """The chat completion request that serves ``request``; a 400 naming what cannot be honoured."""
    unknown = list(request.model_extra or {})
    if unknown:
        raise HTTPError(400, f"unsupported field '{unknown[0]}'", param=unknown[0])
    if request.thinking is not None and request.thinking.get("type") != "disabled":
        raise HTTPError(400, "extended 'thinking' is not supported here; omit it", param="thinking")
    for i, tool in enumerate(request.tools or []):
        for name in tool.model_extra or {}:
            raise HTTPError(400, f"tools.{i}: unsupported field '{name}'", param=f"tools.{i}.{name}")
    tool_choice, parallel = _tool_choice(request.tool_choice)
    if parallel is False and tool_choice not in ("required",) and not isinstance(tool_choice, dict):
        raise HTTPError(
            400,
            "tool_choice.disable_parallel_tool_use is honoured with tool_choice 'any' or 'tool' (one call, "
            "forced); with 'auto' the model may make several calls and they are all recorded: omit it",
            param="tool_choice.disable_parallel_tool_use",
        )
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": _messages(request),
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "top_k": request.top_k or 0,
        "stop": request.stop_sequences or None,
        "stream": request.stream,
        "stream_options": {"include_usage": True} if request.stream else None,
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
    }
    if request.tools:
        fields["tools"] = [api.function_tool(t.name, t.description, t.input_schema) for t in request.tools]
    try:
        return api.ChatCompletionRequest(**fields)
    except ValidationError as err:
        raise invalid_translation(err) from None


def _stop(finish_reason: str | None, stop_reason) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a chat choice's ending."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _arguments(text: str) -> dict:
    parsed = json.loads(text or "{}")
    return parsed if isinstance(parsed, dict) else {}


def to_message(completion: ChatCompletion) -> Message:
    from anthropic.types import Message, TextBlock, ToolUseBlock, Usage  # ~1 s to import: on first use, not at start

    [choice] = completion.choices
    content: list[TextBlock | ToolUseBlock] = []
    if choice.message.content:
        content.append(TextBlock(type="text", text=choice.message.content))
    for call in choice.message.tool_calls or []:
        arguments = _arguments(call.function.arguments)
        content.append(ToolUseBlock(type="tool_use", id=call.id, name=call.function.name, input=arguments))
    stop_reason, stop_sequence = _stop(choice.finish_reason, getattr(choice, "stop_reason", None))
    return Message(
        id=completion.id,
        type="message",
        role="assistant",
        model=completion.model,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=Usage(input_tokens=completion.usage.prompt_tokens, output_tokens=completion.usage.completion_tokens),
    )


def _event(kind: str, **data) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def stream(turn, params, chunks: AsyncIterator) -> AsyncIterator[str]:
    """Anthropic's stream events for a streamed turn (``service.chat``'s ``frame``):
    ``message_start``, a text block as tokens arrive, one ``tool_use`` block per
    call once it is complete, ``message_delta`` with the stop reason and usage,
    ``message_stop``; an error after the start is an ``error`` event."""
    message = {
        "id": turn.id,
        "type": "message",
        "role": "assistant",
        "model": turn.g.settings.served_model_name,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": len(turn.prompt_ids), "output_tokens": 0},
    }
    index = 0  # of the content block being written
    text_open = False
    ending: tuple[str, str | None] = ("end_turn", None)
    try:
        yield _event("message_start", message=message)
        async for chunk in turn.chunks(params, chunks):
            chunk: ChatCompletionChunk
            if not chunk.choices:  # the usage chunk: the turn is recorded
                delta = {"stop_reason": ending[0], "stop_sequence": ending[1]}
                yield _event("message_delta", delta=delta, usage={"output_tokens": chunk.usage.completion_tokens})
                yield _event("message_stop")
                continue
            choice = chunk.choices[0]
            delta = choice.delta
            if delta.content:
                if not text_open:
                    yield _event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                    text_open = True
                yield _event("content_block_delta", index=index, delta={"type": "text_delta", "text": delta.content})
            if text_open and (delta.tool_calls or choice.finish_reason):
                yield _event("content_block_stop", index=index)
                index, text_open = index + 1, False
            for call in delta.tool_calls or []:
                block = {"type": "tool_use", "id": call.id, "name": call.function.name, "input": {}}
                yield _event("content_block_start", index=index, content_block=block)
                partial = {"type": "input_json_delta", "partial_json": call.function.arguments or "{}"}
                yield _event("content_block_delta", index=index, delta=partial)
                yield _event("content_block_stop", index=index)
                index += 1
            if choice.finish_reason:
                ending = _stop(choice.finish_reason, getattr(choice, "stop_reason", None))
    except Exception as err:  # a parser's or the engine's own error too: the stream ends with one
        if not isinstance(err, HTTPError | SessionError):
            err = broken_stream(err)
        yield _event("error", error=anthropic_error_body(err.status, err.message)["error"])
    finally:  # also when the client goes away mid-stream
        turn.settle()
