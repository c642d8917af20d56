"""Anthropic's Messages API: the translation to a chat turn (unit), and the route
served without Ray Serve (as in test_serving.py: the real HF engine on tiny-random,
called with the official ``anthropic`` client through httpx's ASGI transport).
The multi-turn tool episode over real HTTP is in test_gateway.py."""

from __future__ import annotations

import anthropic
import httpx2
import pytest

from rlgate.serving import anthropic as messages_api
from rlgate.serving.chat import exchange_keys, extend_key
from rlgate.serving.errors import HTTPError
from tests.support import start

TOOL = {
    "name": "calculator",
    "description": "Evaluates arithmetic.",
    "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}},
}


def request(**fields) -> messages_api.MessagesRequest:
    return messages_api.MessagesRequest(**{"model": "m", "max_tokens": 8, **fields})


def test_a_tool_episode_translates_to_chat_messages():
    chat = messages_api.to_chat(
        request(
            system=[{"type": "text", "text": "Be brief."}],
            messages=[
                {"role": "user", "content": "What is 6 * 7?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Let me compute."},
                        {"type": "tool_use", "id": "call_1", "name": "calculator", "input": {"expression": "6 * 7"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "call_1", "content": [{"type": "text", "text": "42"}]},
                        {"type": "text", "text": "Thanks.", "cache_control": {"type": "ephemeral"}},
                    ],
                },
            ],
            tools=[TOOL],
            tool_choice={"type": "auto"},
            stop_sequences=["END"],
            temperature=0.5,
            top_k=4,
            metadata={"user_id": "u"},
        )
    )
    assert [m.for_template() for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 6 * 7?"},
        {
            "role": "assistant",
            "content": "Let me compute.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": "6 * 7"}},
                }
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "user", "content": "Thanks."},
    ]
    assert chat.tools[0].function.parameters == TOOL["input_schema"] and chat.tool_choice == "auto"
    assert (chat.max_tokens, chat.temperature, chat.top_k, chat.top_p, chat.stop) == (8, 0.5, 4, 1.0, ["END"])


def test_an_echoed_answer_continues_the_conversation_it_answered():
    """The assistant message a client sends back (text and tool_use blocks) has the
    key of the chat answer it came from, so the next turn extends its tokens."""
    asked = [{"role": "user", "content": "What is 6 * 7?"}]
    answered = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"function": {"name": "calculator", "arguments": '{"expression": "6 * 7"}'}}],
    }
    echoed = messages_api.to_chat(
        request(
            messages=[
                *asked,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "call_1", "name": "calculator", "input": {"expression": "6 * 7"}}
                    ],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "42"}]},
            ],
            tools=[TOOL],
        )
    )
    tools = [t.model_dump(exclude_none=True) for t in echoed.tools]
    keys = exchange_keys([m.for_template() for m in echoed.messages], tools)
    assert keys[1] == extend_key(exchange_keys(asked, tools)[0], answered)


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking", "'thinking' is not supported"),
        ({"container": "c"}, "container", "unsupported field 'container'"),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
            "messages",
            "tool_result blocks belong in user messages",
        ),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(fields, param, says):
    with pytest.raises(HTTPError) as refused:
        messages_api.to_chat(request(**{"messages": [{"role": "user", "content": "x"}], **fields}))
    assert refused.value.status == 400 and refused.value.param == param and says in refused.value.message


GREEDY = {"temperature": 0}  # sampling fields are extensions: the SDK no longer has them


def client(http, key: str, base_url: str = "http://gateway") -> anthropic.AsyncAnthropic:
    """The SDK over the same app (it brings its own httpx fork, httpx2)."""
    transport = httpx2.ASGITransport(app=http._transport.app)
    return anthropic.AsyncAnthropic(
        base_url=base_url, api_key=key, http_client=httpx2.AsyncClient(transport=transport), max_retries=0
    )


async def test_a_session_of_two_messages_turns_is_one_exact_sequence(served, tiny_tokenizer):  # noqa: F811
    http, manager, saved = served
    key = await start(http)
    asked = [{"role": "user", "content": "Hello"}]
    first = await client(http, key).messages.create(
        model="tiny-random", system="Be brief.", messages=asked, max_tokens=5, extra_body=GREEDY
    )
    assert first.id.startswith("msg_") and first.type == "message" and first.role == "assistant"
    assert first.stop_reason == "max_tokens" and first.usage.output_tokens == 5 and first.usage.input_tokens > 0
    [block] = first.content
    assert block.type == "text" and block.text
    history = asked + [{"role": "assistant", "content": first.content}, {"role": "user", "content": "Go on"}]
    events = []
    async with client(http, key).messages.stream(
        model="tiny-random", system="Be brief.", messages=history, max_tokens=4, extra_body=GREEDY
    ) as stream:
        async for event in stream:
            events.append(event.type)
        second = await stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop" and "content_block_delta" in events
    assert second.stop_reason == "max_tokens" and second.usage.output_tokens == 4
    reward = await http.post("/rl/set_reward", json={"reward": 1.0}, headers=bearer(key))
    assert reward.status_code == 200 and reward.json()["interaction_id"] == second.id
    ended = await http.post("/rl/end_session", headers=bearer(key))
    assert ended.json()["interaction_count"] == 2
    [record] = saved  # one sequence: the second turn continued the first
    assert sum(record["loss_mask"]) == 5 + 4 and record["interaction_ids"] == [first.id, second.id]
    assert tiny_tokenizer.decode(record["input_ids"][-4:]) == second.content[0].text
    assert manager.stats()["open_sessions"] == 0


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def test_refusals_are_anthropic_errors_and_record_nothing(served):  # noqa: F811
    http, manager, _ = served
    key = await start(http)
    messages = client(http, key).messages
    asked = [{"role": "user", "content": "x"}]
    with pytest.raises(anthropic.AuthenticationError) as refused:
        await client(http, "rlg-not-a-key").messages.create(model="tiny-random", messages=asked, max_tokens=2)
    assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError, match="'thinking' is not supported"):
        await messages.create(
            model="tiny-random", messages=asked, max_tokens=2, thinking={"type": "enabled", "budget_tokens": 1024}
        )
    with pytest.raises(anthropic.NotFoundError, match="is not served here"):
        await messages.create(model="claude-9", messages=asked, max_tokens=2)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    with pytest.raises(anthropic.UnprocessableEntityError, match="blocks of type 'image' are not supported"):
        await messages.create(model="tiny-random", messages=[{"role": "user", "content": [image]}], max_tokens=2)
    with pytest.raises(anthropic.BadRequestError, match="needs the vLLM engine"):  # this test's engine is HF
        await messages.create(
            model="tiny-random", messages=asked, max_tokens=2, tools=[TOOL], tool_choice={"type": "any"}
        )
    stats = manager.stats()
    assert (stats["open_sessions"], stats["open_interactions"]) == (1, 0)
    bearer_agent = anthropic.AsyncAnthropic(  # the SDK's auth_token: a bearer token, as some agents send it
        base_url="http://gateway",
        auth_token=key,
        http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=http._transport.app)),
        max_retries=0,
    )
    assert (await bearer_agent.messages.create(model="default", messages=asked, max_tokens=2)).usage.output_tokens
    reply = await client(http, "ignored", f"http://gateway/s/{key}").messages.create(
        model="default", messages=asked, max_tokens=2
    )
    assert reply.usage.output_tokens >= 1 and manager.stats()["open_interactions"] == 2
