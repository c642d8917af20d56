"""A tool parser of vLLM's registry on the serving path: tiny-tools (trained to
call a calculator in the Hermes format) behind the serving path without Ray
Serve with `[gateway] tool_parser = "vllm:hermes"`, the real HF engine, the
official openai client: calls whole and streamed, and the episode one sequence."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from rlgate.models import CALCULATOR_TOOL, prepare_model
from tests.support import ADMIN, serving_app

ASK = [{"role": "user", "content": "What is 6 * 7?"}]


@pytest.fixture(scope="module")
async def tools_engine():
    from rlgate.rollout.engines.hf import HFEngine

    engine = HFEngine(prepare_model("tiny-tools"), max_model_len=1024)
    await engine.ready()
    yield engine
    await engine.shutdown()


async def serve(engine, tmp_path, tool_parser: str, special_markers: bool = False):
    """An agent's client, the HTTP client, its session key and the saved records, on a
    gateway with ``tool_parser``; ``special_markers``: the tokenizer marks <tool_call> special."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepare_model("tiny-tools"))
    if special_markers:  # as some models' tokenizers do: decoding without special tokens drops the tags
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<tool_call>", "</tool_call>"]})
        assert "<tool_call>" in tokenizer.all_special_tokens
    app, _, saved = serving_app(engine, tokenizer, tmp_path, "tiny-tools", tool_parser=tool_parser)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    started = await http.post("/rl/start_session", json={"task_id": "t"}, headers={"Authorization": f"Bearer {ADMIN}"})
    key = started.json()["api_key"]
    return openai.AsyncOpenAI(base_url="http://gw/v1", api_key=key, http_client=http), http, key, saved


@pytest.fixture
async def gateway(tools_engine, tmp_path):

    served = await serve(tools_engine, tmp_path, "vllm:hermes")
    yield served
    await served[1].aclose()


async def test_vllms_hermes_parser_serves_a_tool_episode(gateway):
    agent, http, key, saved = gateway
    chat = agent.chat.completions
    first = await chat.create(model="tiny-tools", messages=ASK, tools=[CALCULATOR_TOOL], temperature=0, max_tokens=64)
    [call] = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and json.loads(call.function.arguments) == {
        "expression": "6 * 7"
    }
    stream = await chat.create(
        model="tiny-tools", messages=ASK, tools=[CALCULATOR_TOOL], temperature=0, max_tokens=64, stream=True
    )
    chunks = [c async for c in stream if c.choices]
    streamed = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed] == [
        ("calculator", {"expression": "6 * 7"})
    ]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks).strip()  # no markup leaked as text
    history = ASK + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "42"},
    ]
    second = await chat.create(
        model="tiny-tools", messages=history, tools=[CALCULATOR_TOOL], temperature=0, max_tokens=64
    )
    assert second.choices[0].message.content == "The answer is 42."
    await http.post("/rl/end_session", headers={"Authorization": f"Bearer {key}"})
    [episode] = [r for r in saved if r["interaction_ids"][-1] == second.id]
    # the answer continued a call turn (the streamed one, the latest of the two alike): one sequence
    assert episode["interaction_ids"] == [chunks[0].id, second.id]


@pytest.mark.parametrize("tool_parser", ["hermes", "vllm:hermes"])
async def test_calls_whose_markers_are_special_tokens_are_parsed(tools_engine, tmp_path, tool_parser):
    """Where the tokenizer marks <tool_call> special, the parser still reads it (the
    text it parses keeps its markers; other special tokens stay out)."""
    agent, http, key, _ = await serve(tools_engine, tmp_path, tool_parser, special_markers=True)
    try:
        chat = agent.chat.completions
        whole = await chat.create(
            model="tiny-tools", messages=ASK, tools=[CALCULATOR_TOOL], temperature=0, max_tokens=64
        )
        [call] = whole.choices[0].message.tool_calls
        assert (
            json.loads(call.function.arguments) == {"expression": "6 * 7"} and whole.choices[0].message.content is None
        )
        stream = await chat.create(
            model="tiny-tools", messages=ASK, tools=[CALCULATOR_TOOL], temperature=0, max_tokens=64, stream=True
        )
        chunks = [c async for c in stream if c.choices]
        assert [t.function.name for c in chunks for t in c.choices[0].delta.tool_calls or []] == ["calculator"]
        plain = await chat.create(model="tiny-tools", messages=ASK, temperature=0, max_tokens=64)  # no tools: text
        assert "<|im_end|>" not in plain.choices[0].message.content  # other special tokens stay out
    finally:
        await http.aclose()
