"""Visible text, incremental detokenisation and logprob shapes, on the byte-level tiny-random tokenizer."""

from __future__ import annotations

import random

import pytest

from rlgate.serving.openai_format import TextStream, TokenText, chat_logprobs, visible_text


@pytest.fixture(scope="module")
def tok(tiny_tokenizer):
    return tiny_tokenizer


def ids_of(tok, text, end=True):
    return tok.encode(text, add_special_tokens=False) + ([tok.convert_tokens_to_ids("<|im_end|>")] if end else [])


def random_splits(ids, rng):
    """``ids`` cut into consecutive chunks of 1 to 4 ids."""
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        chunks.append(ids[i : i + n])
        i += n
    return chunks


def streamed(tok, chunks, stops, stop_reason):
    stream = TextStream(tok, stops)
    pieces = [stream.push(chunk) for chunk in chunks]
    return pieces, stream.finish(stop_reason)


def test_visible_text(tok):
    ids = ids_of(tok, "Hello world. STOP here")
    assert visible_text(tok, ids, None) == "Hello world. STOP here"  # <|im_end|> dropped
    assert visible_text(tok, ids, "STOP") == "Hello world. "
    assert visible_text(tok, ids, "ld.") == "Hello wor"
    assert visible_text(tok, ids, "absent") == "Hello world. STOP here"
    assert visible_text(tok, ids, ids[-1]) == "Hello world. STOP here"  # a stop token id cuts nothing
    assert visible_text(tok, ids_of(tok, "héllo 世界"), None) == "héllo 世界"


@pytest.mark.parametrize("text", ["The answer is 42.", "héllo 世界! ünïcödé 🎉 done", "Hello , world . <tool_call>{}"])
def test_text_stream_without_stops_matches_visible_text(tok, text):
    ids, rng = ids_of(tok, text), random.Random(text)
    expected = visible_text(tok, ids, None)
    for _ in range(50):
        pieces, rest = streamed(tok, random_splits(ids, rng), [], None)
        assert "".join(pieces) + rest == expected
        assert not any("\ufffd" in p for p in pieces)


def test_text_stream_with_stops_not_matched(tok):
    """Stop strings that never occur (finish by length): everything arrives, the tail held back till finish."""
    ids, rng = ids_of(tok, "The answer is 42, not 24.", end=False), random.Random(1)
    for _ in range(50):
        pieces, rest = streamed(tok, random_splits(ids, rng), ["STOP", "xyz"], None)
        assert "".join(pieces) + rest == "The answer is 42, not 24."


def test_text_stream_one_token_at_a_time_never_emits_broken_characters(tok):
    text = "héllo 世界 🎉"
    ids = ids_of(tok, text, end=False)
    assert len(ids) > len(text)  # multi-byte characters really are split across tokens
    stream = TextStream(tok, [])
    pieces = [stream.push([i]) for i in ids]
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + stream.finish(None) == text


@pytest.mark.parametrize(
    "text, stops, stop",
    [
        ("The answer is 4", ["is 4"], "is 4"),  # " is", " ", "4": the stop string straddles three tokens
        ("The answer", ["answ", "zz"], "answ"),  # it ends inside the last token " answer"
        ("Let me think. Done", [" Done"], " Done"),
        ("naïve 世界", ["世界"], "世界"),  # a multi-byte stop string
        ("abc STOP", ["STOP"], "STOP"),
    ],
    ids=["straddling", "mid-token", "word", "multibyte", "plain"],
)
def test_text_stream_stops_before_a_matched_stop_string(tok, text, stops, stop):
    """As an engine does, the completion ends with the tokens that spelled the stop
    string; nothing streamed may contain any part of it."""
    ids = ids_of(tok, text, end=False)
    expected = visible_text(tok, ids, stop)
    assert expected == text[: text.index(stop)]
    rng = random.Random(text)
    for _ in range(50):
        pieces, rest = streamed(tok, random_splits(ids, rng), stops, stop)
        assert "".join(pieces) + rest == expected, pieces


def test_token_text_caches_per_id(tok):
    calls = []

    class Counting:
        def decode(self, ids, skip_special_tokens=False):
            calls.append(ids)
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    text_of = TokenText(Counting())
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert [text_of(end), text_of(end)] == ["<|im_end|>", "<|im_end|>"]
    assert calls == [[end]]


def test_chat_logprobs_shapes(tok):
    ids = ids_of(tok, "The answer")
    logprobs = [-0.1, -0.2, -0.3][: len(ids)]
    assert len(ids) == 3
    text_of = TokenText(tok)
    top = [{ids[0]: -0.1, 5: -2.0, 7: -1.0}, {ids[1]: -0.2}, {}]
    entries = chat_logprobs(text_of, ids, logprobs, top)
    assert [e.token for e in entries] == ["The", " answer", "<|im_end|>"]
    assert [e.logprob for e in entries] == [-0.1, -0.2, -0.3]
    assert entries[1].bytes == list(b" answer")
    assert [len(e.top_logprobs) for e in entries] == [3, 1, 0]
    assert [t.logprob for t in entries[0].top_logprobs] == [-0.1, -1.0, -2.0]  # most likely first
    assert [t.token for t in entries[0].top_logprobs] == ["The", tok.decode([7]), tok.decode([5])]
    assert entries[0].top_logprobs[1].bytes == list(tok.decode([7]).encode())
    plain = chat_logprobs(text_of, ids, logprobs, None)
    assert len(plain) == 3 and all(e.top_logprobs == [] for e in plain)
    assert chat_logprobs(text_of, [], [], None) == []


def test_text_stream_decodes_each_token_once(tok):
    """Streaming never decodes the whole completion again per chunk (that made
    a long stream quadratic): pushes decode only the new tokens, and only the
    end decodes everything, once."""

    class Counting:
        def __init__(self, inner):
            self.inner, self.decoded = inner, 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def decode(self, ids, **kwargs):
            self.decoded += len(ids)
            return self.inner.decode(ids, **kwargs)

    counting = Counting(tok)
    ids = ids_of(tok, "The answer is 42. " * 200, end=False)
    stream = TextStream(counting, ["STOP"])
    pieces = [stream.push([i]) for i in ids]
    assert counting.decoded == 0
    assert "".join(pieces) + stream.finish(None) == "The answer is 42. " * 200
    assert counting.decoded == len(ids)
