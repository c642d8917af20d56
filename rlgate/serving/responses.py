"""OpenAI's Responses API (``POST /v1/responses``) over the chat completion path.

As for Anthropic's Messages (:mod:`rlgate.serving.anthropic`), a request is
translated to a chat completion request and served as one: same session, same
chat template, token-exact continuation, same record. The answer becomes a
``Response`` or the Responses stream events.

Translation:

* ``instructions`` -> a leading system message (not carried over by
  ``previous_response_id``, as OpenAI's);
* ``input`` text -> a user message; message items (``input_text`` /
  ``output_text`` parts) -> messages of their role; ``function_call`` items ->
  tool calls of the assistant message before them (or of a new one);
  ``function_call_output`` items -> tool messages;
* function ``tools`` and ``tool_choice`` as on chat completions;
  ``text.format`` as ``response_format``; ``max_output_tokens``,
  ``temperature``, ``top_p`` as sampling parameters.

``previous_response_id`` continues the conversation of an earlier response of
the same session key: the replica that served it keeps its messages in memory
(:class:`ResponseLog`, the most recent ``[gateway] responses_kept``; none with
``store: false``), so a conversation may also be sent whole as ``input``. A
response whose messages are not held here is a 404 that says so.
"""

from __future__ import annotations

import json
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Literal

from openai.types.chat import ChatCompletion
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlgate.serving import api
from rlgate.serving.errors import HTTPError, broken_stream, error_body, invalid_translation
from rlgate.sessions.manager import SessionError

ID_PREFIX = "resp_"


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ResponsesRequest(api._Request):
    model: str = Field(min_length=1)
    input: str | list[dict] = Field(description="Text, or a list of input items.")
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    text: dict | None = None
    reasoning: dict | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    # Accepted for compatibility; not used.
    metadata: dict | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    stream_options: dict | None = None


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise HTTPError(400, f"{where}.content must be text or a list of text parts", param="input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise HTTPError(
                400,
                f"{where}.content.{j}: parts of type {kind!r} are not supported (input_text, output_text)",
                param="input",
            )
        parts.append(part["text"])
    return "".join(parts)


def input_messages(items: str | list[dict]) -> list[dict]:
    """Chat messages for ``input``; a 400 naming the first item that cannot be read."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise HTTPError(400, f"{where}.role must be user, system, developer or assistant", param="input")
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise HTTPError(400, f"{where}: a function_call needs call_id, name and arguments", param="input")
            call = api.tool_call(item["call_id"], item["name"], item["arguments"])
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise HTTPError(400, f"{where}: a function_call_output needs call_id", param="input")
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(output, where)})
        else:
            raise HTTPError(400, f"{where}: input items of type {kind!r} are not supported", param="input")
    return messages


def _refuse_unhonoured(request: ResponsesRequest) -> None:
    unknown = list(request.model_extra or {})
    if unknown:
        raise HTTPError(400, f"unsupported field '{unknown[0]}'", param=unknown[0])
    if request.reasoning not in (None, {}) and request.reasoning.get("effort") is not None:
        raise HTTPError(400, "'reasoning' is not supported here; omit it", param="reasoning")
    if request.truncation == "auto":
        raise HTTPError(400, "'truncation': 'auto' is not supported (nothing is dropped to fit)", param="truncation")
    if request.include:
        raise HTTPError(400, f"'include' is not supported ({request.include[0]!r})", param="include")
    if request.top_logprobs:
        raise HTTPError(400, "'top_logprobs' is not supported on /v1/responses", param="top_logprobs")


def _response_format(text: dict | None) -> dict | None:
    """Chat's ``response_format`` for Responses' ``text.format`` (``json_schema``'s
    name, schema and strict sit in the format itself there)."""
    form = (text or {}).get("format")
    if not isinstance(form, dict) or form.get("type") != "json_schema":
        return form
    return {"type": "json_schema", "json_schema": {k: v for k, v in form.items() if k != "type"}}


def _tool_choice(choice):
    if isinstance(choice, dict):  # {"type": "function", "name": ...}: forces a call (refused downstream)
        return {"type": "function", "function": {"name": choice.get("name", "")}}
    return choice


class ResponseLog:
    """The messages of recent responses, for ``previous_response_id``: the most
    recent ``capacity``, each usable only with the session key that made it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, tuple[str, list[dict]]] = OrderedDict()

    def remember(self, response_id: str, key_hash: str, history: list[dict]) -> None:
        if self.capacity <= 0:
            return
        self.entries[response_id] = (key_hash, history)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def history(self, response_id: str, key_hash: str) -> list[dict]:
        entry = self.entries.get(response_id)
        if entry is None or entry[0] != key_hash:
            raise HTTPError(
                404,
                f"previous_response_id {response_id!r} is not held by this gateway replica (it keeps the "
                f"{self.capacity} most recent responses of live sessions, in memory); send the conversation as input",
                param="previous_response_id",
            )
        self.entries.move_to_end(response_id)
        return entry[1]

    def forget(self, key_hash: str) -> None:
        """A session ended: its responses can no longer be continued."""
        for response_id in [r for r, (k, _) in self.entries.items() if k == key_hash]:
            del self.entries[response_id]


class ResponsesCall:
    """One ``/v1/responses`` request: its chat request, and how the answer is framed and remembered."""

    def __init__(self, request: ResponsesRequest, log: ResponseLog, key_hash: str) -> None:
        _refuse_unhonoured(request)
        self.request, self.log, self.key_hash = request, log, key_hash
        earlier = log.history(request.previous_response_id, key_hash) if request.previous_response_id else []
        self.history = earlier + input_messages(request.input)  # what a later response continues
        system = [{"role": "system", "content": request.instructions}] if request.instructions is not None else []
        fields: dict[str, Any] = {
            "model": request.model,
            "messages": system + self.history,
            "max_tokens": request.max_output_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "stream": request.stream,
            "stream_options": {"include_usage": True} if request.stream else None,
            "tool_choice": _tool_choice(request.tool_choice),
            "parallel_tool_calls": request.parallel_tool_calls,
            "response_format": _response_format(request.text),
        }
        if request.tools:
            fields["tools"] = [api.function_tool(t.name, t.description, t.parameters) for t in request.tools]
        try:
            self.chat = api.ChatCompletionRequest(**fields)
        except ValidationError as err:
            raise invalid_translation(err) from None

    # --- the answer ----------------------------------------------------------

    def _remember(self, response_id: str, content: str | None, calls: list[dict]) -> None:
        if not self.request.store:
            return
        answer: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            answer["tool_calls"] = [api.tool_call(c["call_id"], c["name"], c["arguments"]) for c in calls]
        self.log.remember(response_id, self.key_hash, self.history + [answer])

    def _response(self, response_id, created, status, output, usage=None, incomplete=False) -> dict:
        """A ``Response`` object (as plain JSON: its SDK type gains required fields from release to release)."""
        request = self.request
        tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
        return {
            "id": response_id,
            "object": "response",
            "created_at": created,
            "status": status,
            "model": request.model,
            "output": output,
            "instructions": request.instructions,
            "previous_response_id": request.previous_response_id,
            "tools": tools,
            "tool_choice": request.tool_choice or "auto",
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "max_output_tokens": request.max_output_tokens,
            "store": request.store,
            "text": {"format": (request.text or {}).get("format") or {"type": "text"}},  # as asked, and honoured
            "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "metadata": request.metadata,
        }

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {
            "input_tokens": prompt_tokens,
            "output_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        }

    def response(self, completion: ChatCompletion) -> dict:
        [choice] = completion.choices
        output: list = []
        if choice.message.content:
            output.append(_message_item(choice.message.content, "completed"))
        calls = choice.message.tool_calls or []
        calls = [_call_item(c.id, c.function.name, c.function.arguments, "completed") for c in calls]
        output += calls
        self._remember(completion.id, choice.message.content, calls)
        usage = self._usage(completion.usage.prompt_tokens, completion.usage.completion_tokens)
        incomplete = choice.finish_reason == "length"
        return self._response(
            completion.id, completion.created, "incomplete" if incomplete else "completed", output, usage, incomplete
        )

    async def stream(self, turn, params, chunks: AsyncIterator) -> AsyncIterator[str]:
        """The Responses stream events for a streamed turn (``service.chat``'s ``frame``)."""
        sequence = 0

        def event(kind: str, **data) -> str:
            nonlocal sequence
            sequence += 1
            payload = {"type": kind, "sequence_number": sequence - 1, **data}
            return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

        output: list = []
        message, text = None, ""  # the text item being written
        finish = None
        try:
            started = self._response(turn.id, turn.created, "in_progress", [])
            yield event("response.created", response=started)
            yield event("response.in_progress", response=started)
            async for chunk in turn.chunks(params, chunks):
                if not chunk.choices:  # the usage chunk: the turn is recorded
                    calls = [item for item in output if item["type"] == "function_call"]
                    self._remember(turn.id, text or None, calls)
                    usage = self._usage(chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
                    incomplete = finish == "length"
                    status = "incomplete" if incomplete else "completed"
                    done = self._response(turn.id, turn.created, status, output, usage, incomplete)
                    yield event(f"response.{status}", response=done)
                    continue
                choice = chunk.choices[0]
                delta = choice.delta
                if delta.content:
                    if message is None:
                        message = _message_item("", "in_progress")
                        yield event("response.output_item.added", output_index=len(output), item=message)
                        part = {"type": "output_text", "text": "", "annotations": []}
                        yield event(
                            "response.content_part.added",
                            item_id=message["id"],
                            output_index=len(output),
                            content_index=0,
                            part=part,
                        )
                    text += delta.content
                    yield event(
                        "response.output_text.delta",
                        item_id=message["id"],
                        output_index=len(output),
                        content_index=0,
                        delta=delta.content,
                        logprobs=[],
                    )
                if message is not None and (delta.tool_calls or choice.finish_reason):
                    where = {"item_id": message["id"], "output_index": len(output), "content_index": 0}
                    yield event("response.output_text.done", **where, text=text, logprobs=[])
                    part = {"type": "output_text", "text": text, "annotations": []}
                    yield event("response.content_part.done", **where, part=part)
                    message = _message_item(text, "completed", message["id"])
                    yield event("response.output_item.done", output_index=len(output), item=message)
                    output.append(message)
                    message = None
                for call in delta.tool_calls or []:
                    arguments = call.function.arguments or "{}"
                    item = _call_item(call.id, call.function.name, "", "in_progress")
                    at = {"output_index": len(output)}
                    yield event("response.output_item.added", **at, item=item)
                    yield event("response.function_call_arguments.delta", **at, item_id=item["id"], delta=arguments)
                    yield event("response.function_call_arguments.done", **at, item_id=item["id"], arguments=arguments)
                    item = _call_item(call.id, call.function.name, arguments, "completed", item["id"])
                    yield event("response.output_item.done", **at, item=item)
                    output.append(item)
                if choice.finish_reason:
                    finish = choice.finish_reason
        except Exception as err:  # a parser's or the engine's own error too: the stream ends with one
            if not isinstance(err, HTTPError | SessionError):
                err = broken_stream(err)
            body = error_body(err.status, err.message)["error"]
            yield event("error", code=body["code"], message=body["message"], param=body["param"])
        finally:  # also when the client goes away mid-stream
            turn.settle()


def _message_item(text: str, status: str, item_id: str | None = None) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": []}] if text else []
    item_id = item_id or "msg_" + secrets.token_hex(12)
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _call_item(call_id: str, name: str, arguments: str, status: str, item_id: str | None = None) -> dict:
    item_id = item_id or "fc_" + secrets.token_hex(12)
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
