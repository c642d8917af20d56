"""Tool calls out of model text: examples, a reference oracle, and streaming in
every split, all checked against the same whole-text answer."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlgate.models import CHATML_TOOLS_TEMPLATE
from rlgate.serving.toolcalls import (
    CLOSE,
    OPEN,
    HermesToolParser,
    ParsedOutput,
    detect_parser,
    get_parser,
)

parser = HermesToolParser()
PROPERTY = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def render_call(name, arguments) -> str:
    """One call as CHATML_TOOLS_TEMPLATE writes it (its tojson keeps non-ASCII)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{OPEN}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}{CLOSE}'


def calls_of(parsed: ParsedOutput) -> list[tuple[str, object]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def without_ids(parsed: ParsedOutput):
    return parsed.content, [(call.name, call.arguments) for call in parsed.tool_calls]


# --- examples ------------------------------------------------------------------


def test_single_call():
    parsed = parser.parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert parsed.content is None
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", '{"city": "Paris"}')]


def test_two_calls_after_content():
    text = "Let me check both.\n" + render_call("a", {"x": 1}) + "\n" + render_call("b", {"y": [1, 2]})
    parsed = parser.parse(text)
    assert parsed.content == "Let me check both."
    assert calls_of(parsed) == [("a", {"x": 1}), ("b", {"y": [1, 2]})]


def test_arguments_as_a_json_string_and_parameters_synonym():
    as_string = parser.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert calls_of(as_string) == [("f", {"a": 1})]
    synonym = parser.parse('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>')
    assert calls_of(synonym) == [("f", {"a": 1})]
    missing = parser.parse('<tool_call>{"name": "f"}</tool_call>')
    assert calls_of(missing) == [("f", {})]


def test_non_ascii_arguments_stay_readable():
    parsed = parser.parse('<tool_call>{"name": "translate", "arguments": {"text": "naïve 東京 🙂"}}</tool_call>')
    assert parsed.tool_calls[0].arguments == '{"text": "naïve 東京 🙂"}'


@pytest.mark.parametrize("text", ["", "  plain answer, with spaces \n", "a < b and tool > c", "</tool_call> stray"])
def test_plain_text_is_unchanged_but_for_leading_whitespace(text):
    assert parser.parse(text) == ParsedOutput(content=text.lstrip(), tool_calls=[])


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',  # missing brace
        "<tool_call>[1,2]</tool_call>",  # not an object
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # name not a string
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',  # empty name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
        "<tool_call></tool_call>",
    ],
)
def test_malformed_blocks_stay_in_content(block):
    assert parser.parse(block) == ParsedOutput(content=block, tool_calls=[])
    mixed = parser.parse(f"Before {block}\n{render_call('ok', {})}")
    assert mixed.content == f"Before {block}"
    assert calls_of(mixed) == [("ok", {})]


def test_unclosed_block_stays_in_content():
    cut = 'Checking.\n<tool_call>{"name": "f", "argum'
    assert parser.parse(cut) == ParsedOutput(content=cut, tool_calls=[])
    after_a_call = render_call("f", {}) + "\n" + cut
    assert parser.parse(after_a_call).content == cut


def test_a_block_inside_an_unclosed_one_is_still_found():
    parsed = parser.parse('<tool_call>oops <tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert parsed.content == "<tool_call>oops"
    assert calls_of(parsed) == [("f", {})]


def test_ids_are_unique_and_openai_shaped():
    parsed = parser.parse("\n".join(render_call("f", {"i": i}) for i in range(50)))
    ids = [call.id for call in parsed.tool_calls]
    assert len(set(ids)) == 50
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


def test_round_trip_through_the_tiny_random_template():
    jinja2 = pytest.importorskip("jinja2")
    env = jinja2.Environment()
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)  # as transformers renders it
    calls = [("search", {"q": "ray serve", "k": 3}), ("open", {"path": "/tmp/ä.txt", "flags": [True, None, 1.5]})]
    message = {
        "role": "assistant",
        "content": "Two steps.",
        "tool_calls": [{"function": {"name": n, "arguments": a}} for n, a in calls],
    }
    rendered = env.from_string(CHATML_TOOLS_TEMPLATE).render(messages=[message], tools=None)
    body = rendered.removeprefix("<|im_start|>assistant\n").removesuffix("<|im_end|>\n")
    parsed = parser.parse(body)
    assert parsed.content == "Two steps."
    assert calls_of(parsed) == calls


def test_registry_and_detection():
    assert isinstance(get_parser("hermes"), HermesToolParser)
    assert detect_parser(CHATML_TOOLS_TEMPLATE) == "hermes"
    assert detect_parser("{{ '<tool_call>\n<function=' + name }}") == "qwen3_coder"
    assert detect_parser("{{ '[TOOL_CALLS]' }}") == "mistral" and detect_parser("<|python_tag|>") == "llama3_json"
    assert detect_parser("{{ messages }}") is None
    assert detect_parser(None) is None


@pytest.fixture(scope="module")
def tools_tokenizer():
    from transformers import AutoTokenizer

    from rlgate.models import prepare_model

    return AutoTokenizer.from_pretrained(prepare_model("tiny-random"))


CALC = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}
VLLM_OUTPUTS = {  # what models of each family write, and the call in it
    "pythonic": '[calc(expression="6 * 7")]',
    "qwen3_coder": "<tool_call>\n<function=calc>\n<parameter=expression>\n6 * 7\n</parameter>\n"
    "</function>\n</tool_call>",
    "vllm:hermes": '<tool_call>{"name": "calc", "arguments": {"expression": "6 * 7"}}</tool_call>',
}


@pytest.mark.parametrize("name", sorted(VLLM_OUTPUTS))
def test_vllms_parsers_read_their_family_whole_and_streamed(name, tools_tokenizer):
    parser = get_parser(name, tools_tokenizer)
    text = "Let me compute. " + VLLM_OUTPUTS[name] if name != "pythonic" else VLLM_OUTPUTS[name]
    whole = parser.parse(text, [CALC])
    assert calls_of(whole) == [("calc", {"expression": "6 * 7"})]
    stream = parser.stream([CALC])
    ids = tools_tokenizer.encode(text, add_special_tokens=False)
    sent = []
    for token in ids:  # token by token, as an engine streams them
        sent += stream.feed(tools_tokenizer.decode([token]), [token])
    streamed = stream.finish()
    assert calls_of(streamed) == calls_of(whole)
    assert "".join(sent) == (streamed.content or "") and "calc" not in "".join(sent)  # no markup leaked
    plain = parser.parse("No call here.", [CALC])
    assert (plain.content, plain.tool_calls) == ("No call here.", [])


def test_an_answer_streamed_whole_as_text_is_not_also_a_call():
    """llama3_json reads a call in words followed by the JSON only in the whole text;
    streamed, it lets all of it through as content. The client has text, so the
    streamed answer is that text alone, as vLLM's server streams it, not the text
    and a call too. Whitespace before the JSON is not words: that is a call, streamed too."""
    from transformers import AutoTokenizer

    from rlgate.models import prepare_model

    tokenizer = AutoTokenizer.from_pretrained(prepare_model("tiny-random"))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|python_tag|>"]})  # the parser's marker
    parser = get_parser("llama3_json", tokenizer)
    call = '{"name": "calc", "parameters": {"expression": "6 * 7"}}'
    expected = [("calc", {"expression": "6 * 7"})]
    for text, calls in ((f"Sure. {call}", []), (call, expected), (f"\n {call}", expected)):
        stream, sent = parser.stream([CALC]), []
        for token in tokenizer.encode(text, add_special_tokens=False):
            sent += stream.feed(tokenizer.decode([token]), [token])
        streamed = stream.finish()
        assert calls_of(streamed) == calls, text
        assert (streamed.content or "") == "".join(sent) == ("" if calls else text)
    assert calls_of(parser.parse(f"Sure. {call}", [CALC])) == [("calc", {"expression": "6 * 7"})]  # whole: a call


def test_rlgates_hermes_keeps_what_vllms_drops(tools_tokenizer):
    """Measured on the same output: text after a call stays in rlgate's content;
    vLLM's Hermes parser drops it. So `hermes` is rlgate's own."""
    text = 'Checking.\n<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>\nThen I will answer.'
    ours, theirs = get_parser("hermes").parse(text), get_parser("vllm:hermes", tools_tokenizer).parse(text, [CALC])
    assert calls_of(ours) == calls_of(theirs) == [("calc", {"x": 1})]
    assert ours.content == "Checking.\n\nThen I will answer." and theirs.content == "Checking."


def test_a_vllm_parser_that_cannot_read_the_model_is_refused_at_start(tools_tokenizer):
    with pytest.raises(ValueError, match="cannot read this model's output"):
        get_parser("llama3_json", tools_tokenizer)  # tiny-random has no <|python_tag|> token
    with pytest.raises(ValueError, match="unknown parser 'no-such-parser'.*pythonic"):
        get_parser("no-such-parser", tools_tokenizer)


def test_stream_emits_content_as_it_becomes_final():
    stream = parser.stream()
    assert stream.feed("Sure, ") == ["Sure,"]  # the space waits: a call may end the content
    assert stream.feed("checking <tool") == [" checking"]
    assert stream.feed('_call>{"name": "f", "arguments": {}}') == []
    assert stream.tool_calls == []  # no </tool_call> yet
    assert stream.feed("</tool_call>") == []
    assert [c.name for c in stream.tool_calls] == ["f"]
    assert stream.feed(" then <tool_call>[") == ["  then <tool_call>["]  # "[" cannot start a call
    assert stream.feed("1]") == ["1]"]
    assert stream.feed(' <tool_call>{"x": 1}') == [' <tool_call>{"x": 1}']  # a complete object, not a call
    assert stream.feed(' <tool_call>{"name": "g"}') == []  # a call if </tool_call> comes next...
    assert stream.feed(" no") == [' <tool_call>{"name": "g"} no']  # ...it did not
    result = stream.finish()
    assert result.content == 'Sure, checking  then <tool_call>[1] <tool_call>{"x": 1} <tool_call>{"name": "g"} no'
    assert [c.name for c in result.tool_calls] == ["f"]


def test_stream_sends_content_from_its_first_character_that_is_not_whitespace():
    """A reasoning model's content starts with "\n\n" after its thinking: held until
    the end (it was content without calls, not with them), nothing streamed."""
    stream = parser.stream()
    assert stream.feed("\n Hello") == ["Hello"]
    assert stream.feed(" world") == [" world"]
    assert stream.finish().content == "Hello world"
    stream = parser.stream()
    assert stream.feed("\n Hello ") == ["Hello"]
    assert stream.feed(render_call("f", {})) == []
    assert stream.feed(" more") == ["  more"]  # "Hello " + " more": the space before the call was interior
    stream.finish()
    with pytest.raises(RuntimeError):
        stream.feed("x")


# --- properties ------------------------------------------------------------------

FRAGMENTS = [
    OPEN,
    CLOSE,
    "<",
    "</",
    "<tool",
    "tool",
    "_call>",
    "{",
    "}",
    "[",
    "]",
    ":",
    ",",
    '"',
    "\\",
    " ",
    "\n",
    '"name"',
    '"arguments"',
    '"parameters"',
    '"f"',
    "{}",
    '{"a": 1}',
    '"{\\"a\\": 1}"',
    "é",
    "東京",
    "🙂",
    "\u00a0",
    "\x1c",
    render_call("f", {"x": 1}),
    '{"name": "g", "arguments": {}}',
]
texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=4)), max_size=14).map("".join)


def reference(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The documented rule, written independently: innermost blocks, each a call or kept;
    a last block never closed is a call when the rest of the text is one."""
    block = re.compile(f"{re.escape(OPEN)}((?:(?!{re.escape(OPEN)}|{re.escape(CLOSE)}).)*){re.escape(CLOSE)}", re.S)
    calls, content, last = [], [], 0
    for match in block.finditer(text):
        call = reference_call(match.group(1))
        if call is not None:
            content.append(text[last : match.start()])
            calls.append(call)
            last = match.end()
    tail = text.rfind(OPEN)  # a last block never closed: a call if the rest of the text is one
    if tail >= last and CLOSE not in text[tail:]:
        call = reference_call(text[tail + len(OPEN) :])
        if call is not None:
            content.append(text[last:tail])
            calls.append(call)
            last = len(text)
    content.append(text[last:])
    if not calls:
        return text.lstrip(), []
    return "".join(content).strip() or None, calls


def reference_call(inner: str) -> tuple[str, str] | None:
    try:
        obj = json.loads(inner.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    try:
        return obj["name"], json.dumps(args, ensure_ascii=False, allow_nan=False)
    except ValueError:  # NaN, Infinity: not JSON
        return None


@PROPERTY
@given(texts)
def test_parse_never_raises_and_loses_nothing(text):
    parsed = parser.parse(text)
    assert without_ids(parsed) == reference(text)
    if not parsed.tool_calls:
        assert parsed.content == text.lstrip()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
calls_strategy = st.lists(
    st.tuples(st.text(min_size=1, max_size=10), st.dictionaries(st.text(max_size=6), json_values, max_size=4)),
    max_size=4,
)
prose = st.text(max_size=12).filter(lambda s: OPEN not in s)


@PROPERTY
@given(calls_strategy, st.data())
def test_rendered_calls_come_back_in_order(calls, data):
    # A tag inside a JSON string would end the block early: such calls cannot be written.
    calls = [call for call in calls if OPEN not in render_call(*call)[1:] and CLOSE not in render_call(*call)[:-1]]
    around = [data.draw(prose) for _ in range(len(calls) + 1)]
    text = around[0] + "".join(render_call(*call) + after for call, after in zip(calls, around[1:]))
    parsed = parser.parse(text)
    assert calls_of(parsed) == calls
    expected = "".join(around)
    assert parsed.content == ((expected.strip() or None) if calls else expected.lstrip())


def splits(text: str):
    return st.lists(st.integers(0, len(text)), max_size=8).map(lambda cuts: sorted(set(cuts)))


def stream_in(text: str, cuts: list[int]):
    stream = parser.stream()
    emitted = []
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        for piece in stream.feed(text[start:end]):
            assert piece  # never an empty string
            emitted.append(piece)
    return "".join(emitted), stream.finish()


@PROPERTY
@given(st.one_of(texts, calls_strategy.map(lambda cs: " ok ".join(render_call(n, a) for n, a in cs))), st.data())
def test_streaming_agrees_with_parse_in_any_split(text, data):
    cuts = data.draw(splits(text))
    emitted, final = stream_in(text, cuts)
    assert (final.content or "").startswith(emitted)
    assert without_ids(final) == without_ids(parser.parse(text))
    one_char_at_a_time, _ = stream_in(text, list(range(1, len(text))))
    assert (final.content or "").startswith(one_char_at_a_time)


@PROPERTY
@given(st.text(min_size=1).filter(lambda s: "<" not in s and not s[0].isspace()), st.data())
def test_streaming_holds_back_only_trailing_whitespace(text, data):
    emitted, final = stream_in(text, data.draw(splits(text)))
    assert emitted == text.rstrip()
    assert final.content == text


@PROPERTY
@given(prose, calls_strategy.filter(bool), st.data())
def test_content_before_a_call_streams_before_the_end(before, calls, data):
    text = "Answer: " + before + render_call(*calls[0])
    emitted, final = stream_in(text, data.draw(splits(text)))
    if final.tool_calls:
        assert emitted == final.content


def test_stream_holds_an_open_call_until_it_closes():
    stream = parser.stream()
    assert stream.feed('Hi <tool_call>{"name": "f", "argu') == ["Hi"]
    assert stream.feed('ments": {"s": "}"}}\n</tool_') == []
    assert stream.feed("call>") == []
    assert [(c.name, c.arguments) for c in stream.tool_calls] == [("f", '{"s": "}"}')]
    assert without_ids(stream.finish()) == ("Hi", [("f", '{"s": "}"}')])


def test_arguments_that_are_not_json_make_no_call():
    """1e999 and NaN parse in Python, and came out as Infinity/NaN: not JSON."""
    for value in ("1e999", "NaN"):
        text = f'<tool_call>{{"name": "f", "arguments": {{"x": {value}}}}}</tool_call>'
        assert parser.parse(text).tool_calls == []


def test_a_last_call_whose_end_tag_a_stop_string_cut_off_is_still_a_call():
    """An agent that stops after one call (stop=["</tool_call>"]) gets the text
    without the end tag: it was content, the call lost."""
    parsed = parser.parse('Checking.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n')
    assert calls_of(parsed) == [("f", {"a": 1})] and parsed.content == "Checking."
    assert parser.parse('<tool_call>{"name": "f", "arguments": {"a": 1}} and more').tool_calls == []
