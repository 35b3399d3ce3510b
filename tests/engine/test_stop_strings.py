"""Stop strings in the detokenizer and output processor, driven with hand-chosen SmolLM2 token sequences.

SmolLM2 tokenizes "Hello world again" as ["Hello", " world", " again"] and "The cat sat on the mat." as
["The", " cat", " sat", " on", " the", " mat", "."]; the tests assert this so the token boundaries they rely on
are real. Expected texts are written out by hand.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduler_factories import make_request

from pagellm.engine.core_output import EngineCoreOutput
from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.engine.output_processor import OutputProcessor
from pagellm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def hello(tokenizer) -> list[int]:
    ids = tokenizer.encode("Hello world again", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == ["Hello", " world", " again"]
    return ids


@pytest.fixture(scope="module")
def cat(tokenizer) -> list[int]:
    ids = tokenizer.encode("The cat sat on the mat.", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids] == ["The", " cat", " sat", " on", " the", " mat", "."]
    return ids


def run(tokenizer, ids, **params):
    """Feed tokens one by one as the engine would; returns (stop string, final text, streamed deltas, steps)."""
    detok = IncrementalDetokenizer.from_params(tokenizer, SamplingParams(**params))
    deltas = []
    for step, token_id in enumerate(ids, 1):
        last = step == len(ids)
        stop = detok.update([token_id], finished=last)
        deltas.append(detok.get_next_output_text(finished=last or stop is not None, delta=True))
        if stop is not None or last:
            return stop, detok.output_text, deltas, step


def test_stop_string_spanning_two_tokens(tokenizer, hello):
    stop, text, deltas, steps = run(tokenizer, hello, stop=["lo wo"])
    assert (stop, text, steps) == ("lo wo", "Hel", 2)
    assert "".join(deltas) == "Hel"


def test_stop_string_inside_one_token_cuts_the_rest_of_it(tokenizer, hello):
    stop, text, _, steps = run(tokenizer, hello, stop="orl")
    assert (stop, text, steps) == ("orl", "Hello w", 2)  # the "d" of " world" is cut


def test_include_stop_str_in_output(tokenizer, hello):
    assert run(tokenizer, hello, stop=["orl"], include_stop_str_in_output=True)[:2] == ("orl", "Hello worl")
    assert run(tokenizer, hello, stop=["lo wo"], include_stop_str_in_output=True)[:2] == ("lo wo", "Hello wo")


def test_earliest_of_several_stop_strings_wins(tokenizer, cat):
    # The first match in time ends generation, whatever the list order.
    stop, text, _, steps = run(tokenizer, cat, stop=[" the", "at on", "sat"])
    assert (stop, text, steps) == ("sat", "The cat ", 3)
    # In one step (" mat" arrives), " m" starts before "at": the earliest match wins, not the first listed.
    stop, text, _, _ = run(tokenizer, cat, stop=["at.", "mat", " m"])
    assert (stop, text) == (" m", "The cat sat on the")


def test_no_match_keeps_everything(tokenizer, cat):
    stop, text, deltas, steps = run(tokenizer, cat, stop=["dog", "mat!"])
    assert (stop, text, steps) == (None, "The cat sat on the mat.", 7)
    assert "".join(deltas) == text


def test_held_back_text_is_released_only_when_safe(tokenizer, hello):
    # With "world!" (6 chars) as a stop string, 5 chars stay back while the request runs.
    _, text, deltas, _ = run(tokenizer, hello, stop=["world!"])
    assert deltas == ["", "Hello ", "world again"]  # "Hello" (5 chars) held; the rest released at the end
    assert text == "Hello world again"


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), include=st.booleans())
def test_streamed_text_is_never_retracted(tokenizer, cat, data, include):
    full = "The cat sat on the mat."
    def substring():
        start = data.draw(st.integers(0, len(full) - 1))
        return full[start:start + data.draw(st.integers(1, 8))]
    stops = data.draw(st.lists(st.one_of(st.builds(substring), st.text("xyz", min_size=1, max_size=9)),
                               min_size=1, max_size=3))
    stop, text, deltas, _ = run(tokenizer, cat, stop=stops, include_stop_str_in_output=include)
    streamed = ""
    for delta in deltas:
        streamed += delta
        assert text.startswith(streamed)  # every prefix shown was final
    assert streamed == text
    # Reference: the first step whose full decode contains a stop string ends it, cut at the earliest
    # occurrence in that text (ties: first listed).
    for k in range(1, len(cat) + 1):
        so_far = tokenizer.decode(cat[:k])
        hits = [(so_far.find(s), i, s) for i, s in enumerate(stops) if s in so_far]
        if hits:
            at, _, s = min(hits)
            assert stop == s and text == so_far[:at + len(s) if include else at]
            break
    else:
        assert stop is None and text == full


def core_output(token_id: int, finish_reason: str | None = None, request_id: str = "r") -> EngineCoreOutput:
    return EngineCoreOutput(request_id, request_id, 0, [token_id], finish_reason=finish_reason)


def test_output_processor_reports_stop_and_streams_safe_text(tokenizer, hello):
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", [1, 2, 3], params=SamplingParams(stop=["again"], max_tokens=10)))
    seen, tokens = [], []
    for token_id in hello:
        result = processor.process_outputs([core_output(token_id)], delta=True)
        (output,) = result.request_outputs
        seen.append(output.outputs[0].text)
        tokens += output.outputs[0].token_ids
    assert result.stopped == {"r": "again"}
    assert output.finished and output.outputs[0].finish_reason == "stop" and output.outputs[0].stop_reason == "again"
    # len("again") - 1 = 4 chars held back while running; on finish the rest, cut before the stop string.
    assert seen == ["H", "ello w", "orld "]
    assert tokens == hello  # delta outputs carry only the new token ids
    assert not processor.has_unfinished_requests()  # the detokenizer is dropped on finish


def test_output_processor_length_finish_with_stop_in_last_token(tokenizer, hello):
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", [1, 2, 3], params=SamplingParams(stop=["world"], max_tokens=2)))
    processor.process_outputs([core_output(hello[0])])
    # The scheduler ended it by length in the same step.
    result = processor.process_outputs([core_output(hello[1], finish_reason="length")])
    completion = result.request_outputs[0].outputs[0]
    assert result.stopped == {}  # already finished in the core: nothing to finish there
    assert (completion.text, completion.finish_reason, completion.stop_reason) == ("Hello ", "stop", "world")
    assert completion.token_ids == hello[:2]  # cumulative mode: all tokens


def test_output_processor_without_detokenize(tokenizer, hello):
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", [1, 2, 3], params=SamplingParams(detokenize=False, max_tokens=3)))
    outputs = [core_output(t, finish_reason="length" if i == len(hello) - 1 else None) for i, t in enumerate(hello)]
    (output,) = processor.process_outputs(outputs).request_outputs
    assert output.outputs[0].text == "" and output.outputs[0].finish_reason == "length"


def test_output_processor_groups_n_sequences(tokenizer, hello):
    """n = 2: one RequestOutput per step; finished only when both sequences are, with both completions."""
    processor = OutputProcessor(tokenizer)
    processor.add_request(make_request("r", [1, 2, 3], params=SamplingParams(n=2, max_tokens=3)))
    first = processor.process_outputs([core_output(hello[0]), EngineCoreOutput("r/1", "r", 1, [hello[1]])])
    (output,) = first.request_outputs
    assert [c.index for c in output.outputs] == [0, 1] and not output.finished
    second = processor.process_outputs([EngineCoreOutput("r/1", "r", 1, [hello[2]], finish_reason="length")])
    (output,) = second.request_outputs
    assert not output.finished and output.outputs[1].finish_reason == "length"
    (output,) = processor.process_outputs([core_output(hello[2], finish_reason="length")]).request_outputs
    assert output.finished
    assert [(c.index, c.text) for c in output.outputs] == [(0, "Hello again"), (1, " world again")]
    assert not processor.has_unfinished_requests()


def test_sampling_params_stop_validation():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams().stop == []
    with pytest.raises(ValueError, match="empty"):
        SamplingParams(stop=["a", ""])
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["a"], detokenize=False)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[1])
