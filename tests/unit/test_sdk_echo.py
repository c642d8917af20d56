"""What the official SDKs send back in a tool loop: the reply's own message object
appended to the conversation as it is, then the tool's result. The gateway runs in
this process (no Ray Serve) over a scripted engine that answers with text and a
Hermes tool call, and is called with the real ``openai`` and ``anthropic`` clients."""

from __future__ import annotations

import json

import anthropic
import httpx
import httpx2
import openai
import pytest

from rlgate.rollout.engines.base import TokenChunk
from tests.support import serving_app, start

ANSWER = 'Let me check.\n<tool_call>{"name": "lookup", "arguments": {"a": 1}}</tool_call>'
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
CHAT_TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": SCHEMA}}]
MESSAGES_TOOLS = [{"name": "lookup", "input_schema": SCHEMA}]


class Scripted:
    """Every completion is ANSWER, token by token, then end of sequence."""

    def __init__(self, tokenizer) -> None:
        self.ids = tokenizer.encode(ANSWER, add_special_tokens=False) + [tokenizer.eos_token_id]

    async def generate(self, prompt_ids, params, whole=False):
        for i in range(params.n):
            for k, token in enumerate(self.ids):
                last = k == len(self.ids) - 1
                finish, stop = ("stop", token) if last else (None, None)
                yield TokenChunk(
                    index=i, token_ids=[token], logprobs=[-0.5], versions=[0], finish_reason=finish, stop_reason=stop
                )


@pytest.fixture
async def gateway(tiny_tokenizer, tmp_path):
    app, manager, saved = serving_app(Scripted(tiny_tokenizer), tiny_tokenizer, tmp_path, tool_parser="hermes")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        yield app, http, await start(http), saved


def anthropic_messages(app, key: str):
    """The anthropic SDK's messages resource over ``app`` (it brings its own httpx fork, httpx2)."""
    transport = httpx2.ASGITransport(app=app)
    client = anthropic.AsyncAnthropic(
        base_url="http://gateway", api_key=key, http_client=httpx2.AsyncClient(transport=transport), max_retries=0
    )
    return client.messages


async def ended(http, key: str, saved: list) -> dict:
    answer = await http.post("/rl/end_session", headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 200, answer.text
    [record] = saved
    return record


@pytest.mark.parametrize("streamed", [False, True])
async def test_an_openai_reply_message_sent_back_as_it_is_continues_the_session(gateway, streamed):
    """The SDK sends back refusal/annotations/audio/function_call as null (422 before)."""
    app, http, key, saved = gateway
    chat = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=key, http_client=http, max_retries=0).chat
    asked = [{"role": "user", "content": "hi"}]
    if streamed:
        async with chat.completions.stream(model="tiny-random", messages=asked, tools=CHAT_TOOLS) as stream:
            reply = (await stream.get_final_completion()).choices[0].message
    else:
        reply = (
            (await chat.completions.create(model="tiny-random", messages=asked, tools=CHAT_TOOLS)).choices[0].message
        )
    [call] = reply.tool_calls
    history = [*asked, reply, {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    second = await chat.completions.create(model="tiny-random", messages=history, tools=CHAT_TOOLS, temperature=None)
    assert second.choices[0].message.tool_calls
    record = await ended(http, key, saved)
    assert len(record["interaction_ids"]) == 2  # one sequence: the second turn extended the first's tokens


@pytest.mark.parametrize("streamed", [False, True])
async def test_an_anthropic_reply_sent_back_as_it_is_continues_the_session(gateway, streamed):
    """The SDK's ToolUseBlock carries caller and toolset_name (null): a 422 before,
    whose message named the wrong branch of the content union."""
    app, http, key, saved = gateway
    messages = anthropic_messages(app, key)
    asked = [{"role": "user", "content": "hi"}]
    if streamed:
        async with messages.stream(model="tiny-random", max_tokens=64, messages=asked, tools=MESSAGES_TOOLS) as stream:
            reply = await stream.get_final_message()
    else:
        reply = await messages.create(model="tiny-random", max_tokens=64, messages=asked, tools=MESSAGES_TOOLS)
    use = reply.content[-1]
    assert reply.stop_reason == "tool_use" and use.type == "tool_use"
    history = [
        *asked,
        {"role": "assistant", "content": reply.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]},
    ]
    strict = [{**MESSAGES_TOOLS[0], "strict": True}]
    second = await messages.create(model="tiny-random", max_tokens=64, messages=history, tools=strict)
    assert second.stop_reason == "tool_use"
    record = await ended(http, key, saved)
    assert len(record["interaction_ids"]) == 2


async def test_what_the_messages_api_cannot_honour_is_named(gateway):
    app, http, key, _ = gateway
    messages = anthropic_messages(app, key)
    asked = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.BadRequestError, match="tools.0: unsupported field 'defer_loading'"):
        await messages.create(
            model="tiny-random", max_tokens=8, messages=asked, tools=[{**MESSAGES_TOOLS[0], "defer_loading": True}]
        )
    with pytest.raises(anthropic.BadRequestError, match="disable_parallel_tool_use is honoured with tool_choice 'any'"):
        await messages.create(
            model="tiny-random",
            max_tokens=8,
            messages=asked,
            tools=MESSAGES_TOOLS,
            tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        )
    server_call = {"type": "tool_use", "id": "t1", "name": "lookup", "input": {}, "caller": {"type": "code_execution"}}
    with pytest.raises(anthropic.UnprocessableEntityError, match="caller 'code_execution' is not supported"):
        await messages.create(
            model="tiny-random",
            max_tokens=8,
            messages=[*asked, {"role": "assistant", "content": [server_call]}],
            tools=MESSAGES_TOOLS,
        )


async def test_responses_answer_the_sdks_own_types_strictly(gateway):
    """``Response.model_validate`` as the SDK's strict parsing would: usage's
    cache_write_tokens is required; the text format echoes the one asked for."""
    from openai.types.responses import Response

    app, http, key, _ = gateway
    client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=key, http_client=http, max_retries=0)
    answer = await http.post(
        "/v1/responses",
        json={"model": "tiny-random", "input": "hi", "temperature": None, "top_p": None, "store": None},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert answer.status_code == 200, answer.text
    response = Response.model_validate(answer.json())
    assert response.usage.input_tokens_details.cache_write_tokens == 0 and response.text.format.type == "text"
    assert (await client.responses.create(model="tiny-random", input="hi")).status == "completed"


async def test_chat_parameters_sent_as_null_take_their_defaults(gateway):
    app, http, key, _ = gateway
    nulls = dict.fromkeys(("n", "temperature", "top_p", "frequency_penalty", "presence_penalty", "logprobs", "stream"))
    answer = await http.post(
        "/v1/chat/completions",
        json={"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], **nulls},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 1
    streamed = await http.post(
        "/v1/chat/completions",
        json={
            "model": "tiny-random",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {},
        },
        headers={"Authorization": f"Bearer {key}"},
    )
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert chunks and all(chunk.get("usage") is None for chunk in chunks)  # as OpenAI: usage only when asked for


def test_null_means_not_given_except_where_null_has_a_meaning():
    """/v1/completions' max_tokens null is vLLM's "up to the context": it became the
    default 16. Unknown parameters sent as null are simply not given (not a 400)."""
    from rlgate.serving import api

    completion = api.CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": None})
    assert completion.max_tokens is None
    chat = api.ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": None, "service_tier": None}
    )
    assert chat.temperature == 1.0 and api.unsupported_fields(chat) == []
