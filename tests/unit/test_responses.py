"""OpenAI's Responses API: the translation to a chat turn (unit), and the route
served without Ray Serve (as in test_serving.py: the real HF engine on tiny-random,
the official ``openai`` client through httpx's ASGI transport). The tool episode
over real HTTP is in test_gateway.py."""

from __future__ import annotations

import openai
import pytest

from rlgate.serving.chat import exchange_keys, extend_key
from rlgate.serving.errors import HTTPError
from rlgate.serving.responses import ResponseLog, ResponsesCall, ResponsesRequest, input_messages
from tests.support import ADMIN, client, start

TOOL = {
    "type": "function",
    "name": "calculator",
    "description": "Evaluates arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
}
CALL = {"type": "function_call", "call_id": "call_1", "name": "calculator", "arguments": '{"expression": "6 * 7"}'}


def test_input_items_translate_to_chat_messages():
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]
    said = {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed"}
    said["content"] = [{"type": "output_text", "text": "Let me compute.", "annotations": []}]
    assert input_messages(
        [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": "What is 6 * 7?"}]},
            said,
            CALL | {"id": "fc_1", "status": "completed"},
            {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        ]
    ) == [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "What is 6 * 7?"},
        {
            "role": "assistant",
            "content": "Let me compute.",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": CALL["arguments"]}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]


def test_an_echoed_output_continues_the_conversation_it_answered():
    """A function call sent back as an input item has the key of the chat answer it came from."""
    asked = [{"role": "user", "content": "What is 6 * 7?"}]
    call = ResponsesCall(ResponsesRequest(model="m", input=[*asked, CALL], tools=[TOOL]), ResponseLog(8), "k")
    tools = [t.model_dump(exclude_none=True) for t in call.chat.tools]
    keys = exchange_keys([m.for_template() for m in call.chat.messages], tools)
    answered = {"role": "assistant", "content": None, "tool_calls": [{"function": CALL}]}
    assert keys[1] == extend_key(exchange_keys(asked, tools)[0], answered)


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"reasoning": {"effort": "high"}}, "reasoning", "'reasoning' is not supported"),
        ({"text": {"format": {"type": "xml"}}}, "response_format.type", "Input should be"),
        ({"truncation": "auto"}, "truncation", "'auto' is not supported"),
        ({"conversation": "conv_1"}, "conversation", "unsupported field 'conversation'"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "items of type 'reasoning' are not supported"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input", "'input_image' are not"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id", "is not held by this gateway replica"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(fields, param, says):
    with pytest.raises(HTTPError) as refused:
        ResponsesCall(ResponsesRequest(**{"model": "m", "input": "x", **fields}), ResponseLog(8), "k")
    assert refused.value.param == param and says in refused.value.message


def test_the_response_log_is_bounded_and_keyed():
    log = ResponseLog(2)
    for i in range(3):
        log.remember(f"r{i}", "mine", [{"role": "user", "content": str(i)}])
    with pytest.raises(HTTPError, match="not held"):
        log.history("r0", "mine")  # the oldest went first
    with pytest.raises(HTTPError, match="not held"):
        log.history("r2", "theirs")  # another key never reaches it
    assert log.history("r2", "mine") == [{"role": "user", "content": "2"}]
    log.forget("mine")
    assert not log.entries


async def test_a_conversation_of_responses_is_one_exact_sequence(served, tiny_tokenizer):  # noqa: F811
    http, manager, saved = served
    key = await start(http)
    responses = client(http, key).responses
    first = await responses.create(
        model="tiny-random", instructions="Be brief.", input="Hello", max_output_tokens=5, temperature=0
    )
    assert first.id.startswith("resp_") and first.status == "incomplete"
    assert first.incomplete_details.reason == "max_output_tokens" and first.usage.output_tokens == 5
    assert first.output_text and first.output[0].type == "message"
    # continued by id: the earlier messages are held by the replica
    events = []
    stream = await responses.create(
        model="tiny-random",
        instructions="Be brief.",
        previous_response_id=first.id,
        input=[{"role": "user", "content": "Go on"}],
        max_output_tokens=4,
        temperature=0,
        stream=True,
    )
    async for event in stream:
        events.append(event)
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.incomplete" and [e.sequence_number for e in events] == list(range(len(events)))
    second = events[-1].response
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert second.output_text == streamed and second.usage.output_tokens == 4
    # continued by sending the conversation whole, output items as they came back
    third = await responses.create(
        model="tiny-random",
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "Hello"},
            *[item.model_dump(exclude_none=True) for item in first.output],
            {"role": "user", "content": "Go on"},
            *[item.model_dump(exclude_none=True) for item in second.output],
            {"role": "user", "content": "More"},
        ],
        max_output_tokens=3,
        temperature=0,
    )
    reward = await http.post("/rl/set_reward", json={"reward": 1.0}, headers={"Authorization": f"Bearer {key}"})
    assert reward.json()["interaction_id"] == third.id
    ended = await http.post("/rl/end_session", headers={"Authorization": f"Bearer {key}"})
    assert ended.json()["interaction_count"] == 3
    [record] = saved  # one sequence: each turn continued the one before
    assert sum(record["loss_mask"]) == 5 + 4 + 3 and record["interaction_ids"] == [first.id, second.id, third.id]
    assert tiny_tokenizer.decode(record["input_ids"][-3:]) == third.output_text
    assert not manager.stats()["open_sessions"]


async def test_refusals_and_ended_sessions(served):  # noqa: F811
    http, manager, _ = served
    key, other = await start(http), await start(http)
    responses = client(http, key).responses
    first = await responses.create(model="tiny-random", input="Hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError, match="is not held") as refused:
        await client(http, other).responses.create(model="tiny-random", input="x", previous_response_id=first.id)
    assert refused.value.param == "previous_response_id"
    with pytest.raises(openai.UnprocessableEntityError, match="tools.0.type"):
        await responses.create(model="tiny-random", input="x", tools=[{"type": "web_search"}])
    assert manager.stats()["open_interactions"] == 1  # the refusals recorded nothing
    refresh = {"task_id": "t", "api_key": key}
    refreshed = await http.post("/rl/start_session", json=refresh, headers={"Authorization": f"Bearer {ADMIN}"})
    assert refreshed.status_code == 200, refreshed.text
    with pytest.raises(openai.NotFoundError, match="is not held"):  # a refresh: the next episode starts afresh
        await responses.create(model="tiny-random", input="x", previous_response_id=first.id)
