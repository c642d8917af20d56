"""Reasoning models: vLLM's reasoning parsers split thinking into reasoning_content,
chat_template_kwargs reach the template, and thinking is kept across turns token
for token (or follows the template, per session). The real HF engine on
tiny-think (a tiny model trained to think, then answer) behind the serving path
without Ray Serve, called with the official openai client."""

from __future__ import annotations

import httpx
import openai
import pytest

from rlgate.models import prepare_model
from rlgate.serving.reasoning import ReasoningParser
from tests.support import ADMIN, serving_app

ASK = [{"role": "user", "content": "What is 6 * 7?"}]
GREEDY = {"temperature": 0, "max_tokens": 32}


@pytest.fixture(scope="module")
def think_path():
    return prepare_model("tiny-think")


@pytest.fixture(scope="module")
def think_tokenizer(think_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(think_path)


@pytest.fixture(scope="module")
async def think_engine(think_path):
    from rlgate.rollout.engines.hf import HFEngine

    engine = HFEngine(think_path, max_model_len=1024)
    await engine.ready()
    yield engine
    await engine.shutdown()


@pytest.fixture
async def thinking(think_engine, think_tokenizer, tmp_path):
    app, _, saved = serving_app(think_engine, think_tokenizer, tmp_path, "tiny-think", reasoning_parser="qwen3")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        yield http, saved


async def session(http, **options) -> openai.AsyncOpenAI:
    body = {"task_id": "t", **options}
    started = await http.post("/rl/start_session", json=body, headers={"Authorization": f"Bearer {ADMIN}"})
    assert started.status_code == 200, started.text
    return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=started.json()["api_key"], http_client=http)


async def end(agent: openai.AsyncOpenAI) -> None:
    ended = await agent._client.post("/rl/end_session", headers={"Authorization": f"Bearer {agent.api_key}"})
    assert ended.status_code == 200, ended.text


def test_a_parser_is_a_name_of_vllms_registry_and_must_fit_the_tokenizer(think_tokenizer, tiny_tokenizer):
    with pytest.raises(ValueError, match="unknown parser 'qwen9'.*deepseek_r1"):
        ReasoningParser("qwen9", think_tokenizer)
    with pytest.raises(ValueError, match="cannot read this model's output"):
        ReasoningParser("deepseek_r1", tiny_tokenizer)  # tiny-random has no <think> token
    parser = ReasoningParser("deepseek_r1", think_tokenizer)
    split = parser.split("<think>\nSix.\n</think>\n\nThe answer is 42.", None)
    assert (split.reasoning, split.content.strip()) == ("\nSix.\n", "The answer is 42.")


async def test_thinking_is_reasoning_content_whole_and_streamed(thinking):
    http, _ = thinking
    agent = await session(http)
    reply = await agent.chat.completions.create(model="tiny-think", messages=ASK, **GREEDY)
    message = reply.choices[0].message
    assert message.reasoning_content.strip() == "Six times seven." and message.content.strip() == "The answer is 42."
    stream = await agent.chat.completions.create(model="tiny-think", messages=ASK, stream=True, **GREEDY)
    deltas = [chunk.choices[0].delta async for chunk in stream if chunk.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content
    off = await agent.chat.completions.create(
        model="tiny-think", messages=ASK, extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **GREEDY
    )
    assert off.choices[0].message.reasoning_content is None and off.choices[0].message.content == "The answer is 42."
    with pytest.raises(openai.UnprocessableEntityError, match="'tokenize' is set by the gateway"):
        await agent.chat.completions.create(
            model="tiny-think", messages=ASK, extra_body={"chat_template_kwargs": {"tokenize": True}}, **GREEDY
        )
    await end(agent)


async def turns(agent) -> tuple:
    """Two turns: the question, then a follow-up after the answer (sent back with its reasoning)."""
    first = await agent.chat.completions.create(model="tiny-think", messages=ASK, **GREEDY)
    said = first.choices[0].message
    history = ASK + [
        {"role": "assistant", "content": said.content, "reasoning_content": said.reasoning_content},
        {"role": "user", "content": "What is 12 + 30?"},
    ]
    second = await agent.chat.completions.create(model="tiny-think", messages=history, **GREEDY)
    return first, second


async def test_thinking_is_kept_across_turns_token_for_token(thinking, think_tokenizer):
    http, saved = thinking
    agent = await session(http)
    first, second = await turns(agent)
    await end(agent)
    [record] = saved  # one sequence: the second turn continued the first's sampled tokens
    think = think_tokenizer.convert_tokens_to_ids("<think>")
    prompt = record["input_ids"][: second.usage.prompt_tokens]
    first_turn = prompt[: first.usage.prompt_tokens + first.usage.completion_tokens]
    assert think in first_turn[first.usage.prompt_tokens :]  # the first answer's thinking, as sampled
    assert sum(record["loss_mask"]) == first.usage.completion_tokens + second.usage.completion_tokens
    assert record["interaction_ids"] == [first.id, second.id]


async def test_a_session_may_follow_the_template_instead(thinking, think_tokenizer):
    http, saved = thinking
    agent = await session(http, reasoning_history="template")
    first, second = await turns(agent)
    await end(agent)
    assert [r["interaction_ids"] for r in saved] == [[first.id], [second.id]]  # each turn its own sequence
    think = think_tokenizer.convert_tokens_to_ids("<think>")
    second_prompt = saved[1]["input_ids"][: second.usage.prompt_tokens]
    assert think not in second_prompt  # the template dropped the earlier thinking
    rendered = think_tokenizer.apply_chat_template(
        ASK
        + [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "What is 12 + 30?"},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert second_prompt == think_tokenizer.encode(rendered, add_special_tokens=False)


class Scripted:
    """An engine whose every completion is ``answer``, a token at a time."""

    def __init__(self, tokenizer, answer: str) -> None:
        self.ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]

    async def generate(self, prompt_ids, params, whole=False):
        from rlgate.rollout.engines.base import TokenChunk

        for k, token in enumerate(self.ids):
            finish, stop = ("stop", token) if k == len(self.ids) - 1 else (None, None)
            yield TokenChunk(
                index=0, token_ids=[token], logprobs=[-0.5], versions=[0], finish_reason=finish, stop_reason=stop
            )


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
async def test_a_stop_string_does_not_garble_streamed_reasoning(think_tokenizer, tmp_path, parser):
    """With a stop string the stream held its last characters back but handed the
    parser every token id at once: deepseek_r1 split the thinking at the wrong
    place ("'>\\nLet me think'" as reasoning), unlike the same answer not streamed."""
    engine = Scripted(think_tokenizer, "<think>\nLet me think.</think>\n\nThe answer is 42.")
    app, _, _ = serving_app(engine, think_tokenizer, tmp_path, "tiny-think", reasoning_parser=parser)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        agent = await session(http)
        whole = (await agent.chat.completions.create(model="tiny-think", messages=ASK, stop=["##"])).choices[0]
        stream = await agent.chat.completions.create(model="tiny-think", messages=ASK, stop=["##"], stream=True)
        deltas = [chunk.choices[0].delta async for chunk in stream if chunk.choices]
    assert (
        whole.message.reasoning_content.strip() == "Let me think."
        and whole.message.content.strip() == "The answer is 42."
    )
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == whole.message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == whole.message.content


async def test_a_streamed_answer_is_recorded_as_sent_so_the_next_turn_continues_it(think_tokenizer, tmp_path):
    """vLLM's qwen3 parser streams "<think>\n\n</think>..." with thinking off as
    content without "</think>", but the record held its split of the whole text:
    the next turn, which sends back what was streamed, started a new sequence."""
    engine = Scripted(think_tokenizer, "<think>\n\n</think>\n\nThe answer is 42.")
    app, _, saved = serving_app(engine, think_tokenizer, tmp_path, "tiny-think", reasoning_parser="qwen3")
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        agent = await session(http)
        stream = await agent.chat.completions.create(model="tiny-think", messages=ASK, stream=True, extra_body=off)
        said = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        history = [*ASK, {"role": "assistant", "content": said}, {"role": "user", "content": "And 12 + 30?"}]
        await agent.chat.completions.create(model="tiny-think", messages=history, extra_body=off)
        await end(agent)
    [record] = saved  # one sequence: the second turn extended the first
    assert len(record["interaction_ids"]) == 2
