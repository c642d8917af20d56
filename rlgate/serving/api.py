"""HTTP schemas of the gateway: OpenAI-compatible requests and the session routes.

Responses reuse the official ``openai`` SDK's pydantic models, so the shapes
are OpenAI's own. Requests are ours because we must refuse what we cannot
honour: a field we do not support is a 400 that names it (see
:func:`unsupported_fields`), never silently ignored; a value of the wrong
type or out of range is a 422 naming the field (pydantic).
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Request(BaseModel):
    # Unknown fields are kept so they can be reported by name (400), not dropped.
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data):
        """A parameter sent as null is one not given, as OpenAI's and Anthropic's APIs
        take it: their SDKs send an optional parameter given as None that way (wrappers
        that pass every parameter through do so all the time). It takes its default,
        except where null has a meaning of its own (a field that may be None)."""
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or (k in fields and _nullable(fields[k]))}
        return data


def _nullable(field) -> bool:
    return field.annotation is type(None) or type(None) in get_args(field.annotation)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str = Field(min_length=1)
    arguments: str | dict = "{}"


class ToolCallIn(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict:
        """The call as chat templates expect it: ``arguments`` a mapping when it is a
        JSON object (as Hugging Face and vLLM hand it; templates that apply ``tojson``
        to it would otherwise encode the string twice), else as given."""
        call = self.model_dump()
        arguments = call["function"]["arguments"]
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except (ValueError, RecursionError):  # not JSON, or nested past what the parser takes
                parsed = None
            if isinstance(parsed, dict):
                call["function"]["arguments"] = parsed
        return call


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    """A tool call as a chat message carries it (OpenAI's shape)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def function_tool(name: str, description: str | None, parameters: dict | None) -> dict:
    """A function tool as a chat request declares it."""
    function = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = Field(None, description="vLLM's name for reasoning_content.")
    # What the openai SDK sends back when a reply's message object is appended to the
    # conversation as it is (the tool loop): taken when empty; a refusal is the reply's text.
    refusal: str | None = None
    annotations: list | None = None
    audio: dict | None = None
    function_call: dict | None = None
    parsed: Any = None  # chat.completions.parse/stream's: the content, parsed (the content is what counts)

    @model_validator(mode="after")
    def _check(self) -> ChatMessage:
        if self.audio is not None:
            raise ValueError("audio messages are not supported; send the reply's text")
        if self.function_call is not None:
            raise ValueError("function_call (the deprecated form) is not supported; send tool_calls")
        if self.refusal is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry a refusal")
        if self.role != "assistant" and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if (self.reasoning_content is not None or self.reasoning is not None) and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning_content")
        return self

    def for_template(self, reasoning: bool = False) -> dict:
        """The message as chat templates expect it: text content, developer as
        system; ``reasoning``: with its ``reasoning_content`` (else dropped)."""
        text = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        if text is None and self.refusal is not None:  # what the model said, refusing
            text = self.refusal
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        thought = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning and thought is not None:
            message["reasoning_content"] = thought
        return message


class FunctionSpec(BaseModel):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``text``, ``json_object`` (any JSON object) or ``json_schema`` (one that
    follows ``json_schema.schema``): honoured by the vLLM engine's structured outputs."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with, and only with, type 'json_schema'")
        return self


class StreamOptions(BaseModel):
    include_usage: bool = False  # as OpenAI: a usage chunk only when asked for


def _finite(value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


class _Sampling(_Request):
    model: str = Field(min_length=1)
    n: int = Field(1, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="vLLM extension: keep the k most likely tokens; 0 disables.")
    ignore_eos: bool = Field(False, description="vLLM extension: generate max_tokens, past end-of-sequence.")
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63, description="A 64-bit signed integer, as vLLM's takes.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="Accepted for compatibility; not used.")
    # Accepted only at their neutral value; anything else is refused by name.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict | None = None

    _finite_temperature = field_validator("temperature", "top_p", "frequency_penalty", "presence_penalty")(_finite)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 16 or any(not s for s in stops):
            raise ValueError("up to 16 non-empty stop strings")
        return stops


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="vLLM's extension: more variables for the chat template (enable_thinking, ...)."
    )

    @property
    def forces_tool_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value):
        reserved = sorted(set(value or {}) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"{reserved[0]!r} is set by the gateway, not by the request")
        return value


# Arguments of apply_chat_template the gateway sets itself.
RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "messages",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
}


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(description="One prompt: text, or token ids.")
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


# Fields whose value we cannot honour, with the neutral value we accept.
_NEUTRAL = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "logit_bias": (None, {}),
    "parallel_tool_calls": (None, True),
    "echo": False,
    "best_of": (None, 1),
    "suffix": None,
}


def unsupported_fields(request: _Request) -> list[tuple[str, str]]:
    """``(field, message)`` for every field of ``request`` we would otherwise ignore."""
    problems = [(name, f"unsupported field '{name}'") for name in (request.model_extra or {})]
    forced = isinstance(request, ChatCompletionRequest) and request.forces_tool_call
    for name, neutral in _NEUTRAL.items():
        if name == "parallel_tool_calls" and forced:
            continue  # honoured: one call when false
        if name in type(request).model_fields:
            value = getattr(request, name)
            allowed = neutral if isinstance(neutral, tuple) else (neutral,)
            if value not in allowed:
                problems.append((name, f"'{name}' is not supported (only {allowed[0]!r})"))
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs and not request.logprobs:
            problems.append(("top_logprobs", "'top_logprobs' needs 'logprobs': true"))
    return problems


# --- session routes (AReaL-compatible) -------------------------------------


class StartSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task_id: str = Field(min_length=1, max_length=256, description="Groups sessions of the same task for GRPO.")
    api_key: str | None = Field(None, description="A session key to refresh: its session ends and a new one starts.")
    group_size: int | None = Field(
        None, ge=1, le=1024, description="Sessions of this task_id compared in one GRPO group (default: the trainer's)."
    )
    wait_s: float = Field(
        0.0, ge=0, le=600, description="Wait up to this long for capacity before answering 429 (a long poll)."
    )
    train: bool = Field(
        True,
        description="false: an evaluation session; it takes no capacity slot and nothing of it is saved or trained on.",
    )
    reasoning_history: Literal["tokens", "template"] | None = Field(
        None,
        description="How this session's later turns see earlier thinking (default: [gateway] reasoning_history). "
        "tokens: continue from the sampled tokens, token-exact; template: render each turn afresh.",
    )


class StartSessionResponse(BaseModel):
    session_id: str
    api_key: str
    inference_url: str = Field(
        description="A base URL for OpenAI clients scoped to this session: its path is the credential, so "
        "whoever holds it (e.g. a task app) needs no key and reaches no other session."
    )


class SetRewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float
    interaction_id: str | None = Field(None, description="A completion id; default: the latest completion.")
    turn_rewards: list[float] | None = Field(
        None,
        max_length=100_000,
        description="Per-turn rewards: the i-th goes to the session's i-th completion; ``reward`` then goes to "
        "the latest completion on top of its turn reward (a task app's event_rewards and outcome_reward).",
    )

    _finite_reward = field_validator("reward")(_finite)

    @field_validator("turn_rewards")
    @classmethod
    def _finite_turns(cls, values: list[float] | None) -> list[float] | None:
        for value in values or []:
            _finite(value)
        return values

    @model_validator(mode="after")
    def _one_target(self) -> SetRewardRequest:
        if self.turn_rewards is not None and self.interaction_id is not None:
            raise ValueError("give interaction_id or turn_rewards, not both")
        return self


class SetRewardResponse(BaseModel):
    message: str
    interaction_id: str


class EndSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    failed: bool = Field(
        False,
        description="The episode failed (e.g. its environment errored): nothing of it is trained on, and its "
        "GRPO group does not wait for it.",
    )


class EndSessionResponse(BaseModel):
    message: str
    interaction_count: int
