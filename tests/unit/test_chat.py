"""ChatRenderer continuations and exchange keys, with the real tiny-random / tiny-tools tokenizers."""

from __future__ import annotations

import json

import pytest

from rlgate.models import CALCULATOR_TOOL, prepare_model, tool_episode
from rlgate.serving.chat import ChatRenderer, exchange_keys, extend_key


@pytest.fixture(scope="module")
def renderer(tiny_tokenizer):
    return ChatRenderer(tiny_tokenizer)


@pytest.fixture(scope="module")
def tools_renderer():
    from transformers import AutoTokenizer

    return ChatRenderer(AutoTokenizer.from_pretrained(prepare_model("tiny-tools")))


def completion(renderer, text, ended=True):
    """Completion ids as the model would produce them for ``text``."""
    end = [renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")] if ended else []
    return renderer.encode(text) + end


def test_turn_tail(renderer, tools_renderer):
    assert renderer.turn_tail == "<|im_end|>\n"
    assert tools_renderer.turn_tail == "<|im_end|>\n"


def test_renderer_needs_a_chat_template():
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="no chat template"):
        ChatRenderer(NoTemplate())


def test_continuation_of_a_plain_answer(renderer):
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6 * 7?"}]
    done = completion(renderer, "The answer is 42.")
    earlier = renderer.prompt_ids(first, None) + done
    messages = first + [{"role": "assistant", "content": "The answer is 42."}, {"role": "user", "content": "Thanks!"}]
    ids = renderer.continuation_ids(messages, None, upto=2, earlier=earlier, ended_with=done[-1:])
    assert ids == renderer.prompt_ids(messages, None)
    assert ids[: len(earlier)] == earlier
    assert (
        renderer.tokenizer.decode(ids[len(earlier) :])
        == "\n<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n"
    )


def test_continuation_of_a_tool_calling_episode(tools_renderer):
    r, tools = tools_renderer, [CALCULATOR_TOOL]
    (question, call), (answered, reply) = tool_episode("6 * 7")
    first = r.prompt_ids(question, tools) + completion(r, call)
    second_prompt = r.continuation_ids(answered, tools, upto=1, earlier=first, ended_with=first[-1:])
    assert second_prompt == r.prompt_ids(answered, tools)
    # and the turn after the answer, continuing the continuation
    second = second_prompt + completion(r, reply)
    messages = answered + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And 6 * 8?"}]
    third_prompt = r.continuation_ids(messages, tools, upto=3, earlier=second, ended_with=second[-1:])
    assert third_prompt == r.prompt_ids(messages, tools)
    assert third_prompt[: len(second)] == second


@pytest.mark.parametrize(
    "text", ["Hello there", "The answer is 4", "x = {", "Hello <"], ids=["words", "digit", "brace", "ends-with-lt"]
)
def test_continuation_of_a_completion_cut_by_max_tokens(renderer, text):
    """No end token was produced: the prompt supplies the whole turn tail, even when
    the last token ("<") happens to be a prefix of the tail's text."""
    first = [{"role": "user", "content": "Say something."}]
    cut = completion(renderer, text, ended=False)
    earlier = renderer.prompt_ids(first, None) + cut
    messages = first + [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
    ids = renderer.continuation_ids(messages, None, upto=1, earlier=earlier, ended_with=cut[-1:])
    assert ids == renderer.prompt_ids(messages, None)


class DropsReasoning:
    """A tokenizer-like stub whose template drops an earlier assistant turn's
    <think> block once a later user turn follows (as Qwen3's does)."""

    chat_template = "stub"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=False):
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        text = ""
        for i, m in enumerate(messages):
            content = m["content"]
            if m["role"] == "assistant" and i < last_user:
                content = content.split("</think>")[-1]
            text += f"<|im_start|>{m['role']}\n{content}<|im_end|>\n"
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens=False):
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, token):
        return self.tokenizer.convert_tokens_to_ids(token)


def test_continuation_is_none_when_the_template_rewrites_earlier_turns(tiny_tokenizer):
    r = ChatRenderer(DropsReasoning(tiny_tokenizer))
    assert r.turn_tail == "<|im_end|>\n"
    first = [{"role": "user", "content": "Hi"}]
    for answer, rewritten in [("<think>hmm</think>Hello", True), ("Hello", False)]:
        done = completion(r, answer)
        earlier = r.prompt_ids(first, None) + done
        messages = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Bye"}]
        ids = r.continuation_ids(messages, None, upto=1, earlier=earlier, ended_with=done[-1:])
        if rewritten:
            assert ids is None
        else:
            assert ids == r.prompt_ids(messages, None)


def test_continuation_is_none_when_monkeypatched_render_differs(renderer, monkeypatch):
    first = [{"role": "user", "content": "Hi"}]
    done = completion(renderer, "Hello")
    earlier = renderer.prompt_ids(first, None) + done
    messages = first + [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    real = renderer.render
    monkeypatch.setattr(
        renderer, "render", lambda ms, tools, gen, kwargs=None: real(ms, tools, gen, kwargs) + ("" if gen else "extra")
    )
    assert renderer.continuation_ids(messages, None, 1, earlier, done[-1:]) is None


CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "1+2", "x": 1}'},
        }
    ],
}
CONVERSATION = [
    {"role": "user", "content": "What is 1+2?"},
    CALL,
    {"role": "tool", "tool_call_id": "call_1", "content": "3"},
]


def test_exchange_keys_are_stable_per_prefix():
    keys = exchange_keys(CONVERSATION, None)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert keys == exchange_keys(json.loads(json.dumps(CONVERSATION)), None)
    assert exchange_keys(CONVERSATION[:2], None) == keys[:2]
    assert exchange_keys(CONVERSATION, []) == keys  # no tools == empty tools
    changed = [{"role": "user", "content": "What is 1+3?"}] + CONVERSATION[1:]
    assert all(a != b for a, b in zip(exchange_keys(changed, None), keys))


def test_exchange_keys_change_with_tools():
    plain, with_tools = exchange_keys(CONVERSATION, None), exchange_keys(CONVERSATION, [CALCULATOR_TOOL])
    assert all(a != b for a, b in zip(plain, with_tools))
    other_tool = json.loads(json.dumps(CALCULATOR_TOOL))
    other_tool["function"]["description"] = "Adds."
    assert exchange_keys(CONVERSATION, [other_tool]) != with_tools


def test_exchange_keys_treat_string_and_dict_arguments_alike():
    as_dict = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_other",
                "type": "function",
                "function": {"name": "calculator", "arguments": {"x": 1, "expression": "1+2"}},
            }
        ],
    }
    spaced = {
        "role": "assistant",
        "tool_calls": [{"function": {"name": "calculator", "arguments": '{ "x" : 1 ,\n "expression":"1+2" }'}}],
    }
    keys = exchange_keys(CONVERSATION, None)
    assert exchange_keys([CONVERSATION[0], as_dict, CONVERSATION[2]], None) == keys
    assert exchange_keys([CONVERSATION[0], spaced, CONVERSATION[2]], None) == keys
    different = {
        "role": "assistant",
        "tool_calls": [{"function": {"name": "calculator", "arguments": {"expression": "1+3", "x": 1}}}],
    }
    assert exchange_keys([CONVERSATION[0], different], None)[1] != keys[1]


def test_extend_key_matches_exchange_keys():
    for tools in (None, [CALCULATOR_TOOL]):
        keys = exchange_keys(CONVERSATION, tools)
        reply = {"role": "assistant", "content": "It is 3."}
        assert extend_key(keys[-1], reply) == exchange_keys(CONVERSATION + [reply], tools)[-1]
        # the gateway records a call without id/type; the client sends it back with them
        recorded = {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "calculator", "arguments": '{"expression":"1+2","x":1}'}}],
        }
        assert extend_key(keys[0], recorded) == keys[1]


def test_templates_get_tool_call_arguments_as_a_mapping(tiny_tokenizer):
    """A template that applies ``tojson`` to a call's arguments (Llama 3.1's does)
    writes them once: rlgate hands it a mapping, as Hugging Face and vLLM do."""
    import copy

    from rlgate.serving.api import ChatMessage

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    call = {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    torn = {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Pa'}}
    messages = [
        ChatMessage(role="user", content=[{"type": "text", "text": "Weather?"}]).for_template(),
        ChatMessage(role="assistant", content=None, tool_calls=[call, torn]).for_template(),
    ]
    text = ChatRenderer(tokenizer).render(messages, None, True)
    assert 'weather{"city": "Paris"}' in text and 'Paris\\"' not in text  # once, not as a JSON string
    assert 'weather"{\\"city\\": \\"Pa"' in text  # not a JSON object: passed on as the text it is
    assert text.startswith("user: Weather?")  # content parts joined
