"""Request schemas: refusing what we cannot honour, message validation, rewards."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlgate.serving.api import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SetRewardRequest,
    unsupported_fields,
)

USER = [{"role": "user", "content": "Hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=USER, **fields)


def test_a_normal_request_has_no_problems():
    request = chat(
        temperature=0.7,
        top_p=0.9,
        max_tokens=32,
        stop=["\n"],
        seed=1,
        logprobs=True,
        top_logprobs=3,
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        tool_choice="auto",
        parallel_tool_calls=True,
        response_format={"type": "text"},
        frequency_penalty=0,
        presence_penalty=0.0,
        logit_bias=None,
        user="u",
        stream=True,
        stream_options={"include_usage": True},
    )
    assert unsupported_fields(request) == []
    assert unsupported_fields(chat(tool_choice="none", top_logprobs=0)) == []
    assert unsupported_fields(CompletionRequest(model="m", prompt="hi", best_of=1, echo=False)) == []


@pytest.mark.parametrize(
    "fields, name",
    [
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": -1.0}, "presence_penalty"),
        ({"logit_bias": {"42": 10}}, "logit_bias"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"top_logprobs": 5}, "top_logprobs"),
        ({"functions": [{"name": "f"}]}, "functions"),  # an unknown field
    ],
)
def test_unsupported_chat_fields_are_named(fields, name):
    problems = unsupported_fields(chat(**fields))
    assert len(problems) == 1 and problems[0][0] == name and f"'{name}'" in problems[0][1], problems


def test_forced_tool_calls_and_json_output_are_accepted_and_checked():
    named = {"type": "function", "function": {"name": "f"}}
    assert unsupported_fields(chat(tool_choice=named, parallel_tool_calls=False)) == []  # one call: honoured
    assert unsupported_fields(chat(tool_choice="required", response_format={"type": "json_object"})) == []
    schema = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}
    assert chat(response_format=schema).response_format.json_schema.json_schema == {"type": "object"}
    for wrong in ({"type": "json_schema"}, {"type": "text", "json_schema": schema["json_schema"]}, {"type": "xml"}):
        with pytest.raises(ValidationError):
            chat(response_format=wrong)
    with pytest.raises(ValidationError):
        chat(tool_choice={"type": "function", "function": {}})


def test_unsupported_completion_fields_are_named():
    request = CompletionRequest(model="m", prompt=[1, 2], echo=True, best_of=2, suffix="x", mystery=1)
    problems = unsupported_fields(request)
    assert [field for field, _ in problems] == ["mystery", "echo", "best_of", "suffix"]
    assert problems[0] == ("mystery", "unsupported field 'mystery'")


def test_finite_sampling_values():
    with pytest.raises(ValidationError, match="frequency_penalty"):
        chat(frequency_penalty=float("nan"))
    with pytest.raises(ValidationError, match="temperature"):
        chat(temperature=float("inf"))
    with pytest.raises(ValidationError, match="stop"):
        chat(stop=["ok", ""])


def test_tool_message_needs_tool_call_id():
    with pytest.raises(ValidationError, match="tool_call_id"):
        ChatMessage(role="tool", content="3")
    assert ChatMessage(role="tool", content="3", tool_call_id="c1").for_template() == {
        "role": "tool",
        "content": "3",
        "tool_call_id": "c1",
    }


def test_only_assistant_messages_carry_tool_calls():
    call = {"id": "c1", "function": {"name": "calc", "arguments": {"x": 1}}}
    with pytest.raises(ValidationError, match="only assistant"):
        ChatMessage(role="user", content="hi", tool_calls=[call])
    message = ChatMessage(role="assistant", tool_calls=[call]).for_template()
    assert message == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": {"x": 1}}}],
    }


def test_message_content_rules():
    with pytest.raises(ValidationError, match="needs content"):
        ChatMessage(role="user")
    with pytest.raises(ValidationError):
        ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}])
    with pytest.raises(ValidationError):
        ChatMessage(role="narrator", content="hi")
    parts = ChatMessage(role="user", content=[{"type": "text", "text": "Hello, "}, {"type": "text", "text": "you"}])
    assert parts.for_template() == {"role": "user", "content": "Hello, you"}


def test_developer_becomes_system_for_the_template():
    message = ChatMessage(role="developer", content="Be brief.", name="ops")
    assert message.for_template() == {"role": "system", "content": "Be brief.", "name": "ops"}


def test_set_reward_refuses_non_finite():
    assert SetRewardRequest(reward=1).reward == 1.0
    assert SetRewardRequest(reward=-0.5, interaction_id="chatcmpl-1").interaction_id == "chatcmpl-1"
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ValidationError, match="finite"):
            SetRewardRequest(reward=bad)
    with pytest.raises(ValidationError):
        SetRewardRequest.model_validate_json('{"reward": NaN}')
    with pytest.raises(ValidationError):
        SetRewardRequest(reward=1.0, extra=1)


def test_turn_rewards_are_finite_and_exclusive_with_an_interaction_id():
    assert SetRewardRequest(reward=1, turn_rewards=[0.1, 0]).turn_rewards == [0.1, 0.0]
    with pytest.raises(ValidationError, match="finite"):
        SetRewardRequest(reward=1, turn_rewards=[0.1, float("nan")])
    with pytest.raises(ValidationError, match="not both"):
        SetRewardRequest(reward=1, turn_rewards=[0.1], interaction_id="chatcmpl-1")


def test_tool_call_arguments_nested_past_what_json_parses_are_kept_as_text():
    """Arguments that are not a JSON object reach the template as the text they
    are; nesting too deep for Python's parser (a RecursionError, not a
    ValueError) is such text, not a 500."""
    from rlgate.serving.chat import exchange_keys

    deep = "[" * 1000 + "]" * 1000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    message = ChatMessage(role="assistant", content=None, tool_calls=[call]).for_template()
    assert message["tool_calls"][0]["function"]["arguments"] == deep
    assert len(exchange_keys([USER[0], message], None)) == 2
