"""The gateway over real HTTP with the official openai client: a real Serve app
on loopback, the real engine on tiny-tools (tiny-random trained to call a
calculator tool), real SessionStore / TrajectoryStore / CapacityActor."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from rlgate.models import CALCULATOR_TOOL, TOOL_PROBLEMS, prepare_model
from tests.support import gateway_fixture, replica_process

SETTINGS = {
    "model": {"name": "tiny-tools"},
    "rollout": {"max_model_len": 1024, "kv_cache_gib": 0.5, "request_log_size": 64},
    "gateway": {"export_style": "concat", "turn_discount": 0.5, "max_concurrent": 16, "max_body_bytes": 65536},
}


gw = gateway_fixture("gw", SETTINGS)


def client(gw, key, root=False) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url if root else f"{gw.url}/v1", api_key=key, max_retries=0)


def session_headers(key) -> dict:
    return {"Authorization": f"Bearer {key}"}


def ask(question="What is 6 * 7?"):
    return [{"role": "user", "content": question}]


def test_health_and_status(gw):
    health = httpx.get(f"{gw.url}/health").json()
    assert health == {"status": "ok", "workers": 1, "policy_version": 0}
    status = httpx.get(f"{gw.url}/rl/status", headers=gw.admin)
    assert status.status_code == 200
    body = status.json()
    assert {"sessions", "capacity", "engine", "trajectories"} <= set(body)
    assert body["capacity"]["max_concurrent"] == 16
    assert httpx.get(f"{gw.url}/rl/status").status_code == 401


def test_models_lists_the_served_name(gw):
    key = gw.start_session()["api_key"]
    names = [m.id for m in client(gw, key).models.list()]
    assert names == ["tiny-tools"]
    httpx.post(f"{gw.url}/rl/end_session", headers=session_headers(key))


def test_tool_calling_episode_is_one_exact_sequence(gw):
    session = gw.start_session("calc")
    api = client(gw, session["api_key"])
    first = api.chat.completions.create(
        model="tiny-tools", messages=ask(), tools=[CALCULATOR_TOOL], temperature=0, max_tokens=64
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "6 * 7"}
    history = ask() + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "42"},
    ]
    second = api.chat.completions.create(
        model="tiny-tools", messages=history, tools=[CALCULATOR_TOOL], temperature=0, max_tokens=64
    )
    assert second.choices[0].message.content == "The answer is 42."
    assert second.choices[0].finish_reason == "stop"
    reward = httpx.post(f"{gw.url}/rl/set_reward", json={"reward": 1.0}, headers=session_headers(session["api_key"]))
    assert reward.json()["interaction_id"] == second.id
    ended = httpx.post(f"{gw.url}/rl/end_session", headers=session_headers(session["api_key"])).json()
    assert ended["interaction_count"] == 2

    [record] = [r for r in gw.trajectories() if r["session_id"] == session["session_id"]]
    engine_log = gw.rollout.recent_requests.remote(64).result()
    seen = {tuple(entry["prompt_ids"]): entry["outputs"][0] for entry in engine_log}
    # The stored sequence is exactly the second request the engine saw plus its output ...
    second_prompt = record["input_ids"][: len(record["input_ids"]) - second.usage.completion_tokens]
    second_output = seen[tuple(second_prompt)]
    assert record["input_ids"] == second_prompt + second_output["token_ids"]
    # ... and it begins with the first request and its output, token for token.
    first_prompt = next(p for p in seen if len(p) == first.usage.prompt_tokens and list(p) == second_prompt[: len(p)])
    first_output = seen[first_prompt]
    start, end = len(first_prompt), len(first_prompt) + len(first_output["token_ids"])
    assert second_prompt[start:end] == first_output["token_ids"]
    # Loss mask over exactly the two completions; behaviour logprobs and versions as the engine returned them.
    mask = [0] * len(record["input_ids"])
    for offset, length in ((start, end - start), (len(second_prompt), len(second_output["token_ids"]))):
        mask[offset : offset + length] = [1] * length
    assert record["loss_mask"] == mask
    assert record["logprobs"][start:end] == pytest.approx(first_output["logprobs"])
    assert record["logprobs"][len(second_prompt) :] == pytest.approx(second_output["logprobs"])
    assert set(record["versions"][start:end]) == {0}
    assert record["interaction_ids"] == [first.id, second.id]
    # Discounted backwards with turn_discount = 0.5.
    assert record["rewards"] == [0.5, 1.0] and record["reward"] == 0.5


def test_streaming_sends_text_and_tool_calls_incrementally(gw):
    session = gw.start_session("stream")
    api = client(gw, session["api_key"])
    chunks = list(
        api.chat.completions.create(
            model="tiny-tools",
            messages=ask("What is 12 + 30?"),
            tools=[CALCULATOR_TOOL],
            temperature=0,
            max_tokens=64,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    calls = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].function.name == "calculator"
    assert json.loads(calls[0].function.arguments) == {"expression": "12 + 30"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    # plain text streams in pieces as it is generated (how many depends on the machine: tokens the engine
    # produced while the stream was not read arrive together, 3 pieces for 6 tokens under a loaded suite)
    history = ask("What is 12 + 30?") + [
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": calls[0].id,
                    "type": "function",
                    "function": {"name": "calculator", "arguments": calls[0].function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": "42"},
    ]
    streamed = list(
        api.chat.completions.create(
            model="tiny-tools", messages=history, tools=[CALCULATOR_TOOL], temperature=0, max_tokens=64, stream=True
        )
    )
    pieces = [c.choices[0].delta.content for c in streamed if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == "The answer is 42." and len(pieces) > 1
    assert all(c.usage is None and c.choices for c in streamed)  # no usage chunk unless stream_options asks
    httpx.post(f"{gw.url}/rl/end_session", headers=session_headers(session["api_key"]))


def test_an_anthropic_sdk_agent_plays_a_tool_episode_recorded_as_one_exact_sequence(gw):
    """The official anthropic client, as a Claude-style agent: a streamed turn that
    calls the calculator (tool_use), the tool_result sent back, the answer; the
    session holds one token sequence with both turns, as for chat completions."""
    import anthropic

    session = gw.start_session("anthropic")
    agent = anthropic.Anthropic(base_url=gw.url, api_key=session["api_key"], max_retries=0)
    tool = {k: CALCULATOR_TOOL["function"][k] for k in ("name", "description")}
    tool["input_schema"] = CALCULATOR_TOOL["function"]["parameters"]
    asked = ask()
    greedy = {"temperature": 0}  # an extension: the SDK no longer sends sampling fields
    with agent.messages.stream(
        model="tiny-tools", messages=asked, tools=[tool], max_tokens=64, extra_body=greedy
    ) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "input_json" in kinds
    assert first.stop_reason == "tool_use" and first.id.startswith("msg_")
    [call] = [block for block in first.content if block.type == "tool_use"]
    assert call.name == "calculator" and call.input == {"expression": "6 * 7"}
    history = asked + [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "42"}]},
    ]
    second = agent.messages.create(model="tiny-tools", messages=history, tools=[tool], max_tokens=64, extra_body=greedy)
    assert [block.text for block in second.content] == ["The answer is 42."] and second.stop_reason == "end_turn"
    headers = session_headers(session["api_key"])
    reward = httpx.post(f"{gw.url}/rl/set_reward", json={"reward": 1.0}, headers=headers)
    assert reward.json()["interaction_id"] == second.id
    assert httpx.post(f"{gw.url}/rl/end_session", headers=headers).json()["interaction_count"] == 2
    [record] = [r for r in gw.trajectories() if r["session_id"] == session["session_id"]]
    assert record["interaction_ids"] == [first.id, second.id]
    assert sum(record["loss_mask"]) == first.usage.output_tokens + second.usage.output_tokens
    assert len(record["input_ids"]) == second.usage.input_tokens + second.usage.output_tokens
    with pytest.raises(anthropic.APIStatusError) as ended:  # Anthropic's error shape on its route
        agent.messages.create(model="tiny-tools", messages=asked, max_tokens=4)
    assert ended.value.status_code == 410 and ended.value.body["type"] == "error"


def test_a_responses_api_agent_plays_a_tool_episode_recorded_as_one_exact_sequence(gw):
    """The official openai client's Responses API: a streamed turn (the SDK's stream
    helper) that calls the calculator, the function_call_output sent with
    previous_response_id, the answer; one token sequence with both turns."""
    session = gw.start_session("responses")
    agent = client(gw, session["api_key"])
    tool = {"type": "function", **CALCULATOR_TOOL["function"]}
    with agent.responses.stream(
        model="tiny-tools", input="What is 6 * 7?", tools=[tool], temperature=0, max_output_tokens=64
    ) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "6 * 7"}
    second = agent.responses.create(
        model="tiny-tools",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "42"}],
        tools=[tool],
        temperature=0,
        max_output_tokens=64,
    )
    assert second.output_text == "The answer is 42." and second.status == "completed"
    headers = session_headers(session["api_key"])
    assert httpx.post(f"{gw.url}/rl/end_session", headers=headers).json()["interaction_count"] == 2
    [record] = [r for r in gw.trajectories() if r["session_id"] == session["session_id"]]
    assert record["interaction_ids"] == [first.id, second.id]
    assert sum(record["loss_mask"]) == first.usage.output_tokens + second.usage.output_tokens
    assert len(record["input_ids"]) == second.usage.input_tokens + second.usage.output_tokens


def test_forced_tool_calls_and_json_output_are_constrained_and_recorded(gw):
    """A named tool_choice makes the engine write that call in the model's own
    Hermes format, arguments following the schema, even for a question the model
    would not call it for; a json_schema response_format gives JSON of the schema."""
    lookup = {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Find a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    session = gw.start_session("forced")
    api = client(gw, session["api_key"])
    forced = api.chat.completions.create(
        model="tiny-tools",
        messages=ask("Hello"),
        tools=[CALCULATOR_TOOL, lookup],
        tool_choice={"type": "function", "function": {"name": "lookup"}},
        temperature=0,
        max_tokens=160,
    )
    [call] = forced.choices[0].message.tool_calls
    assert forced.choices[0].finish_reason == "tool_calls" and call.function.name == "lookup"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    verdict = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    answered = api.chat.completions.create(
        model="tiny-tools",
        messages=ask("Is 6 * 7 = 42?"),
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": verdict}},
        temperature=0,
        max_tokens=160,
    )
    assert isinstance(json.loads(answered.choices[0].message.content)["ok"], bool)
    # required, one call: the model picks among the tools, in its own format
    required = api.chat.completions.create(
        model="tiny-tools",
        messages=ask("Hello"),
        tools=[lookup],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=160,
    )
    assert [c.function.name for c in required.choices[0].message.tool_calls] == ["lookup"]
    obj = api.chat.completions.create(
        model="tiny-tools", messages=ask(), response_format={"type": "json_object"}, temperature=0, max_tokens=160
    )
    content = obj.choices[0].message.content  # any object: JSON from its first character; whole if it stopped
    assert content.lstrip().startswith("{")
    assert obj.choices[0].finish_reason == "length" or isinstance(json.loads(content), dict)
    headers = session_headers(session["api_key"])
    assert httpx.post(f"{gw.url}/rl/end_session", headers=headers).json()["interaction_count"] == 4
    tokenizer = AutoTokenizer.from_pretrained(prepare_model("tiny-tools"))
    written = [
        tokenizer.decode(r["input_ids"][-forced.usage.completion_tokens :])
        for r in gw.trajectories()
        if r["session_id"] == session["session_id"] and r["interaction_ids"] == [forced.id]
    ]
    assert written[0].startswith('<tool_call>{"name": "lookup", "arguments": ')  # the model's own format


def test_areal_flow_at_the_root_base_url_with_refresh(gw):
    session = gw.start_session("areal")
    root = client(gw, session["api_key"], root=True)  # AReaL clients use the gateway root
    reply = root.chat.completions.create(model="default", messages=ask("What is 9 - 4?"), max_tokens=8)
    assert reply.usage.completion_tokens > 0 and reply.model == "tiny-tools"  # the served name, not the alias
    refreshed = gw.start_session("areal", api_key=session["api_key"], group_size=2)
    assert refreshed["api_key"] == session["api_key"] and refreshed["session_id"] != session["session_id"]
    [old] = [r for r in gw.trajectories() if r["session_id"] == session["session_id"]]
    assert old["end_reason"] == "refreshed" and old["reward"] == 0.0  # no reward set: 0
    assert "group_size" not in old  # only the refreshed session asked for its own group size
    again = root.chat.completions.create(model="tiny-tools", messages=ask("What is 8 * 8?"), max_tokens=8)
    assert again.id != reply.id
    assert httpx.post(f"{gw.url}/rl/end_session", headers=session_headers(session["api_key"])).status_code == 200
    [new] = [r for r in gw.trajectories() if r["session_id"] == refreshed["session_id"]]
    assert new["group_size"] == 2


async def test_async_client_runs_sessions_concurrently(gw):
    sessions = [gw.start_session(f"async-{i}") for i in range(4)]

    async def episode(session, expression):
        api = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=session["api_key"], max_retries=0)
        first = await api.chat.completions.create(
            model="tiny-tools",
            messages=ask(f"What is {expression}?"),
            tools=[CALCULATOR_TOOL],
            temperature=0,
            max_tokens=64,
        )
        call = first.choices[0].message.tool_calls[0]
        history = ask(f"What is {expression}?") + [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "ok"},
        ]
        await api.chat.completions.create(
            model="tiny-tools", messages=history, tools=[CALCULATOR_TOOL], temperature=0, max_tokens=16
        )
        async with httpx.AsyncClient() as http:
            response = await http.post(f"{gw.url}/rl/end_session", headers=session_headers(session["api_key"]))
        return response.json()["interaction_count"]

    counts = await asyncio.gather(*[episode(s, e) for s, e in zip(sessions, ["6 * 7", "9 - 4", "8 * 8", "3 * 14"])])
    assert counts == [2, 2, 2, 2]
    records = {r["session_id"]: r for r in gw.trajectories()}
    for session in sessions:
        assert len(records[session["session_id"]]["interaction_ids"]) == 2  # one branch per episode


def test_rewards_on_chosen_turns_are_discounted_backwards(gw):
    session = gw.start_session("discount")
    api, key = client(gw, session["api_key"]), session["api_key"]
    messages = ask("What is 3 * 14?")
    ids = []
    for follow_up in ["thanks", "and again?"]:
        reply = api.chat.completions.create(model="tiny-tools", messages=messages, max_tokens=6, temperature=0)
        ids.append(reply.id)
        messages = messages + [
            reply.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": follow_up},
        ]
    reply = api.chat.completions.create(model="tiny-tools", messages=messages, max_tokens=6, temperature=0)
    ids.append(reply.id)
    for reward, target in ((2.0, ids[0]), (4.0, None)):  # the first turn by id, the last by default
        body = {"reward": reward} | ({"interaction_id": target} if target else {})
        assert httpx.post(f"{gw.url}/rl/set_reward", json=body, headers=session_headers(key)).status_code == 200
    httpx.post(f"{gw.url}/rl/end_session", headers=session_headers(key))
    [record] = [r for r in gw.trajectories() if r["session_id"] == session["session_id"]]
    assert record["interaction_ids"] == ids
    # G3 = 4; G2 = 0 + 0.5 * 4 = 2; G1 = 2 + 0.5 * 2 = 3
    assert record["rewards"] == [3.0, 2.0, 4.0] and record["reward"] == 3.0


def test_sampling_parameters_reach_the_engine(gw):
    session = gw.start_session("params")
    api = client(gw, session["api_key"])
    two = api.chat.completions.create(
        model="tiny-tools",
        messages=ask("Hello"),
        n=2,
        seed=3,
        temperature=1.0,
        max_tokens=12,
        logprobs=True,
        top_logprobs=3,
    )
    assert len(two.choices) == 2 and two.choices[0].message.content != two.choices[1].message.content
    for choice in two.choices:
        entries = choice.logprobs.content
        assert len(entries) == 12 or choice.finish_reason == "stop"
        assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)
    again = api.chat.completions.create(
        model="tiny-tools", messages=ask("Hello"), n=2, seed=3, temperature=1.0, max_tokens=12
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in two.choices]
    short = api.chat.completions.create(
        model="tiny-tools", messages=ask(), max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
    stopped = api.chat.completions.create(
        model="tiny-tools",
        messages=ask("What is 6 * 7?"),
        temperature=0,
        tools=[CALCULATOR_TOOL],
        max_tokens=64,
        stop=["calculator"],
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert "calculator" not in stopped.choices[0].message.content
    assert stopped.choices[0].message.content == '<tool_call>{"name": "'  # cut before the stop string
    httpx.post(f"{gw.url}/rl/end_session", headers=session_headers(session["api_key"]))


def test_a_vanishing_temperature_is_greedy_and_recorded_as_sampled(gw):
    """temperature=1e-300 overflowed the HF engine's logits and failed its whole
    batch; below 1e-5 every engine samples greedily, and the trajectory says so."""
    session = gw.start_session("vanishing")
    api = client(gw, session["api_key"])
    tiny = api.chat.completions.create(model="tiny-tools", messages=ask(), tools=[CALCULATOR_TOOL], temperature=1e-300)
    greedy = api.chat.completions.create(model="tiny-tools", messages=ask(), tools=[CALCULATOR_TOOL], temperature=0)
    [called] = tiny.choices[0].message.tool_calls  # tiny-tools' learned call, as greedy decoding makes it
    assert called.function == greedy.choices[0].message.tool_calls[0].function
    httpx.post(f"{gw.url}/rl/end_session", headers=session_headers(session["api_key"]))
    records = [r for r in gw.trajectories() if r["session_id"] == session["session_id"]]
    assert records and all(t in (0.0, 1.0) for r in records for t in r["temperatures"])
    assert all(0.0 in r["temperatures"] for r in records)  # the completion's tokens: sampled greedily


def test_legacy_completions_with_text_and_token_ids(gw):
    session = gw.start_session("completions")
    api = client(gw, session["api_key"])
    text = api.completions.create(
        model="tiny-tools", prompt="Hello", max_tokens=5, logprobs=2, temperature=0, extra_body={"ignore_eos": True}
    )
    assert len(text.choices[0].logprobs.tokens) == 5
    tokens = api.completions.create(model="tiny-tools", prompt=[5, 6, 7, 8], max_tokens=4, temperature=0)
    assert tokens.usage.prompt_tokens == 4 and tokens.choices[0].finish_reason in ("length", "stop")
    ended = httpx.post(f"{gw.url}/rl/end_session", headers=session_headers(session["api_key"])).json()
    assert ended["interaction_count"] == 2


def test_trajectories_since_and_loading_with_pandas(gw):
    import pandas as pd

    everything = gw.trajectories()
    assert everything and [r["seq"] for r in everything] == list(range(1, len(everything) + 1))
    assert [r["seq"] for r in gw.trajectories(since=everything[-1]["seq"] - 1)] == [everything[-1]["seq"]]
    files = sorted((gw.run_dir / "trajectories").glob("*.jsonl"))
    frame = pd.concat([pd.read_json(f, lines=True) for f in files])
    assert len(frame) == len(everything)
    assert {
        "session_id",
        "task_id",
        "interaction_ids",
        "rewards",
        "input_ids",
        "loss_mask",
        "logprobs",
        "versions",
    } <= set(frame.columns)


def test_errors_say_what_was_wrong(gw):
    session = gw.start_session("errors")
    key = session["api_key"]
    chat = f"{gw.url}/v1/chat/completions"
    body = {"model": "tiny-tools", "messages": ask(), "max_tokens": 2}

    def post(url=chat, json_body=body, headers=None, content=None):
        headers = {"content-type": "application/json", **(headers or {})}
        return httpx.post(url, json=json_body if content is None else None, content=content, headers=headers)

    def error(response):
        return response.status_code, response.json()["error"]["message"]

    assert error(post())[0] == 401 and "missing API key" in error(post())[1]
    assert error(post(headers={"Authorization": "Basic abc"}))[0] == 401
    assert error(post(headers=session_headers("rlg-not-a-real-key")))[0] == 401
    status, message = error(post(headers=gw.admin))
    assert status == 400 and "admin key is not a session key" in message
    status, message = error(post(json_body={**body, "model": "gpt-4o"}, headers=session_headers(key)))
    assert status == 404 and "tiny-tools" in message
    refused = post(json_body={**body, "logit_bias": {"5": 3}}, headers=session_headers(key))
    assert error(refused)[0] == 400 and refused.json()["error"]["param"] == "logit_bias"
    named = {"type": "function", "function": {"name": "search"}}  # forcing a tool the request does not have
    refused = post(json_body={**body, "tools": [CALCULATOR_TOOL], "tool_choice": named}, headers=session_headers(key))
    assert error(refused)[0] == 400 and "'search', which is not in 'tools'" in error(refused)[1]
    assert refused.json()["error"]["param"] == "tool_choice"
    status, message = error(post(json_body={**body, "response_format": {"type": "xml"}}, headers=session_headers(key)))
    assert status == 422 and "response_format" in message
    status, message = error(post(json_body={"model": "tiny-tools"}, headers=session_headers(key)))
    assert status == 422 and "messages" in message
    status, message = error(
        post(json_body={**body, "messages": [{"role": "robot", "content": "x"}]}, headers=session_headers(key))
    )
    assert status == 422 and "messages.0" in message
    status, message = error(post(content=b'{"model": "tiny-tools", "messages": [', headers=session_headers(key)))
    assert status == 422 and "not valid JSON" in message
    status, message = error(post(json_body={**body, "messages": ask("x" * 70_000)}, headers=session_headers(key)))
    assert status == 413 and "65536" in message

    def chunked():  # no Content-Length: the limit holds as the body arrives
        yield b'{"model": "tiny-tools", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"x" * 1000
        yield b'"}]}'

    status, message = error(post(content=chunked(), headers=session_headers(key)))
    assert status == 413 and "65536" in message
    status, message = error(post(json_body={**body, "max_tokens": 10**9}, headers=session_headers(key)))
    assert status == 400 and "max_tokens" in message
    status, message = error(post(json_body={**body, "messages": ask("x" * 5000)}, headers=session_headers(key)))
    assert status == 400 and "context" in message
    reward = f"{gw.url}/rl/set_reward"
    status, message = error(httpx.post(reward, json={"reward": 1.0}, headers=session_headers(key)))
    assert status == 409 and "no completions" in message
    assert post(headers=session_headers(key)).status_code == 200
    status, message = error(
        httpx.post(reward, json={"reward": 1.0, "interaction_id": "chatcmpl-nope"}, headers=session_headers(key))
    )
    assert status == 404 and "chatcmpl-nope" in message
    assert error(httpx.post(reward, json={"reward": "lots"}, headers=session_headers(key)))[0] == 422
    assert httpx.post(f"{gw.url}/rl/end_session", headers=session_headers(key)).status_code == 200
    status, message = error(post(headers=session_headers(key)))
    assert status == 410 and "ended" in message
    assert error(httpx.post(f"{gw.url}/rl/end_session", headers=session_headers(key)))[0] == 410
    assert (
        error(httpx.post(f"{gw.url}/rl/start_session", json={"task_id": "x"}, headers=session_headers("wrong")))[0]
        == 401
    )


def test_session_keys_never_reach_disk(gw):
    session = gw.start_session("secrets")
    client(gw, session["api_key"]).chat.completions.create(model="tiny-tools", messages=ask(), max_tokens=2)
    httpx.post(f"{gw.url}/rl/end_session", headers=session_headers(session["api_key"]))
    for path in gw.run_dir.rglob("*"):
        if path.is_file():
            text = path.read_text(errors="replace")
            assert session["api_key"] not in text and gw.admin_key not in text


def test_a_task_app_plays_a_multi_turn_tool_episode_through_the_scoped_url(gw):
    """examples/tool_task_app.py, served for real, plays one rollout against the
    gateway: tiny-tools calls the calculator, gets the result, answers; the task
    app needs no key of ours, and the session records one exact sequence."""
    from examples.tool_task_app import app, problem
    from rlgate.sdk.taskapp import EnvSpec, PolicySpec, RolloutRequest, TaskAppClient
    from tests.support import serve_asgi

    seed = next(s for s in range(10_000) if problem(s)[0] in TOOL_PROBLEMS)  # one tiny-tools has learned
    session = gw.start_session("calc-seed")
    assert session["inference_url"] == f"{gw.url}/s/{session['api_key']}/v1"
    policy = {"model": "default", "inference_url": session["inference_url"], "temperature": 0, "max_tokens": 48}
    request = RolloutRequest(
        run_id="t", env=EnvSpec(env_name="calculator", seed=seed), policy=PolicySpec(config=policy)
    )
    with serve_asgi(app) as url:
        response = asyncio.run(TaskAppClient(url, api_key=None).rollout(request))
    assert response.metrics.event_rewards, response.metrics  # the policy called the tool at least once
    assert response.metrics.num_steps == len(response.metrics.event_rewards) + 1  # then answered
    headers = session_headers(session["api_key"])
    assert httpx.post(f"{gw.url}/rl/set_reward", json={"reward": 1.0}, headers=headers).status_code == 200
    before = len(gw.trajectories())
    assert httpx.post(f"{gw.url}/rl/end_session", headers=headers).json()["interaction_count"] >= 2
    [record] = [r for r in gw.trajectories()[before:] if r["session_id"] == session["session_id"]]
    assert sum(record["loss_mask"]) > 0 and record["style"] == "concat" and not record["failed"]


def test_the_scoped_url_reaches_only_its_own_live_session(gw):
    mine, other = gw.start_session("scoped"), gw.start_session("scoped")
    scoped = openai.OpenAI(base_url=mine["inference_url"], api_key="anything-the-app-sends", max_retries=0)
    reply = scoped.chat.completions.create(model="default", messages=ask(), max_tokens=4)
    assert reply.choices[0].message is not None
    assert [m.id for m in scoped.models.list()] == ["tiny-tools"]
    for key in (mine, other):
        httpx.post(f"{gw.url}/rl/end_session", headers=session_headers(key["api_key"]))
    records = gw.trajectories()
    assert {r["session_id"] for r in records if r["task_id"] == "scoped"} == {mine["session_id"]}  # not other's
    with pytest.raises(openai.APIStatusError) as ended:  # an ended session's URL is dead
        scoped.chat.completions.create(model="default", messages=ask(), max_tokens=4)
    assert ended.value.status_code == 410
    guessed = openai.OpenAI(base_url=f"{gw.url}/s/rlg-not-a-key/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        guessed.chat.completions.create(model="default", messages=ask(), max_tokens=4)
    admin_path = httpx.post(
        f"{gw.url}/s/{gw.admin_key}/v1/chat/completions", json={"model": "default", "messages": ask()}
    )
    assert admin_path.status_code == 400 and "admin key" in admin_path.text


def test_a_failed_episode_is_saved_as_a_marker_the_trainer_skips(gw):
    session = gw.start_session("fails", group_size=2)
    client(gw, session["api_key"]).chat.completions.create(model="default", messages=ask(), max_tokens=4)
    headers = session_headers(session["api_key"])
    ended = httpx.post(f"{gw.url}/rl/end_session", json={"failed": True}, headers=headers)
    assert ended.status_code == 200 and "failed" in ended.json()["message"]
    [marker] = [r for r in gw.trajectories() if r["session_id"] == session["session_id"]]
    assert marker["failed"] and marker["input_ids"] == [] and marker["group_size"] == 2
    bad = httpx.post(f"{gw.url}/rl/end_session", json={"failed": "maybe"}, headers=headers)
    assert bad.status_code == 422 and "failed" in bad.text


def test_dashboard_metrics_reach_rays_metrics_endpoint(gw):
    """The gateway's, sessions', trajectories' and capacity's metrics are on Ray's
    Prometheus endpoint (what the dashboard and Grafana read), tagged with the run."""
    import ray

    from rlgate.telemetry import METRICS

    session = gw.start_session("metrics")
    client(gw, session["api_key"]).chat.completions.create(model="default", messages=ask(), max_tokens=4)
    httpx.post(f"{gw.url}/rl/end_session", headers=session_headers(session["api_key"]))
    assert httpx.get(f"{gw.url}/rl/status").status_code == 401
    keys = []  # fill the gateway (max_concurrent 16) until start_session answers 429, then let them go
    while (
        started := httpx.post(f"{gw.url}/rl/start_session", json={"task_id": "fill"}, headers=gw.admin)
    ).status_code == 200:
        keys.append(started.json()["api_key"])
    assert started.status_code == 429 and len(keys) <= 16
    for key in keys:
        httpx.post(f"{gw.url}/rl/end_session", headers=session_headers(key))
    port = next(node["MetricsExportPort"] for node in ray.nodes() if node["Alive"])
    wanted = {name for name in METRICS if not name.startswith("rlgate_train_")}  # those are the driver's
    # Each process reports on its own interval: every name may be out (from earlier tests) before this
    # test's requests are, so wait for the lines this test made as well.
    counted = {("/v1/chat/completions", "200"), ("/rl/status", "401")}
    deadline, missing = time.monotonic() + 90, wanted | counted
    while missing and time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        lines = [line for line in text.splitlines() if "rlgate_requests" in line and 'run="gw"' in line]
        missing = {name for name in wanted if f"ray_{name.removesuffix('_total')}" not in text} | {
            (route, status)
            for route, status in counted
            if not any(f'route="{route}"' in line and f'status="{status}"' in line for line in lines)
        }
        time.sleep(1)
    have = sorted({line.split("{")[0] for line in text.splitlines() if "rlgate" in line and line[0] != "#"})
    assert not missing, f"not exported: {sorted(map(str, missing))}; exported: {have}"
    assert not any(session["api_key"] in line for line in text.splitlines())


def test_a_gateway_replica_serves_without_torch(gw):
    """Only engines and trainers need torch: a Gateway replica (its engines elsewhere)
    tokenizes with the model's tokenizer loaded by class name, and has not mapped
    libtorch after serving every test above (about half the resident memory)."""
    maps = Path(f"/proc/{replica_process('gw', 'Gateway').pid}/maps").read_text()
    assert "libtorch" not in maps
