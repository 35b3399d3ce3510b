"""Per-request options of issue 10 at the engine's edges: `priority` and `cache_salt` are checked against the
engine's settings (scheduling policy, prefix caching) and carried onto the core's Request by the InputProcessor;
the prompt tokens the prefix cache supplied come back as `RequestOutput.num_cached_tokens`."""
from __future__ import annotations

import pytest

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core_output import EngineCoreOutput
from pagellm.engine.input_processor import InputProcessor
from pagellm.engine.output_processor import OutputProcessor
from pagellm.exceptions import InvalidRequestError
from pagellm.sampling_params import BeamSearchParams, SamplingParams
from pagellm.transformers_utils.tokenizer import get_tokenizer

PARAMS = SamplingParams(max_tokens=4)
TOKEN_IDS = [20, 21, 22, 23]



@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return get_tokenizer(str(model_dir))


@pytest.fixture(scope="module")
def make_processor(model_dir, tokenizer):
    """An InputProcessor for an engine built with these EngineArgs (no model is loaded)."""

    def make(**engine_args) -> InputProcessor:
        config = EngineArgs(model=model_dir, max_model_len=128, **engine_args).create_engine_config()
        return InputProcessor(config, num_blocks=64, tokenizer=tokenizer, eos_token_ids=frozenset({2}))

    return make


# ---------------------------------------------------------------------------------------------------- priority
@pytest.mark.parametrize("priority", [-3, 0, 7])
def test_priority_reaches_the_request_under_the_priority_policy(make_processor, priority):
    request = make_processor(scheduling_policy="priority").process("r", "Hello", PARAMS, priority)
    assert request.priority == priority


@pytest.mark.parametrize("policy", ["fcfs", "short-first"])
def test_nonzero_priority_needs_the_priority_policy(make_processor, policy):
    processor = make_processor(scheduling_policy=policy)
    assert processor.process("r", "Hello", PARAMS, 0).priority == 0
    with pytest.raises(InvalidRequestError, match=f"^priority .*{policy}.*--scheduling-policy priority"):
        processor.process("r", "Hello", PARAMS, 1)


@pytest.mark.parametrize("priority", [1.5, "1", True, None])
def test_priority_must_be_an_integer(make_processor, priority):
    with pytest.raises(InvalidRequestError, match="^priority must be an integer"):
        make_processor(scheduling_policy="priority").process("r", "Hello", PARAMS, priority)


# -------------------------------------------------------------------------------------------------- cache_salt
def test_cache_salt_reaches_the_request_from_either_prompt_form(make_processor, tokenizer):
    processor = make_processor()
    text = processor.process("r", {"prompt": "Hello there", "cache_salt": "tenant-a"}, PARAMS)
    assert text.cache_salt == "tenant-a"
    assert text.prompt_token_ids == tokenizer.encode("Hello there")  # the salt is not part of the prompt
    ids = processor.process("r", {"prompt_token_ids": TOKEN_IDS, "cache_salt": "tenant-b"}, PARAMS)
    assert ids.cache_salt == "tenant-b" and ids.prompt_token_ids == TOKEN_IDS
    assert processor.process("r", {"prompt_token_ids": TOKEN_IDS}, PARAMS).cache_salt is None
    assert processor.process("r", "Hello there", PARAMS).cache_salt is None


def test_cache_salt_reaches_a_beam_search(make_processor):
    prompt = {"prompt_token_ids": TOKEN_IDS, "cache_salt": "tenant-a"}
    request, _ = make_processor().process_beam_search("r", prompt, BeamSearchParams(beam_width=2, max_tokens=4))
    assert request.cache_salt == "tenant-a"


@pytest.mark.parametrize("salt", ["", 5, ["a"]])
def test_cache_salt_must_be_a_non_empty_string(make_processor, salt):
    with pytest.raises(InvalidRequestError, match="^cache_salt must be a non-empty string"):
        make_processor().process("r", {"prompt_token_ids": TOKEN_IDS, "cache_salt": salt}, PARAMS)


def test_cache_salt_needs_prefix_caching(make_processor):
    processor = make_processor(enable_prefix_caching=False)
    assert processor.process("r", {"prompt_token_ids": TOKEN_IDS}, PARAMS).cache_salt is None
    with pytest.raises(InvalidRequestError, match="^cache_salt needs prefix caching.*--no-enable-prefix-caching"):
        processor.process("r", {"prompt_token_ids": TOKEN_IDS, "cache_salt": "s"}, PARAMS)


# ------------------------------------------------------------------------------------------- num_cached_tokens
@pytest.mark.parametrize("delta", [False, True])
def test_num_cached_tokens_reaches_every_request_output(make_processor, tokenizer, delta):
    request = make_processor().process("r", {"prompt_token_ids": TOKEN_IDS * 10}, PARAMS)
    processor = OutputProcessor(tokenizer)
    processor.add_request(request)
    for token, finish_reason in ((30, None), (31, "length")):
        output = EngineCoreOutput(request_id="r", group_id="r", index=0, new_token_ids=[token],
                                  finish_reason=finish_reason, num_cached_tokens=32)
        (result,) = processor.process_outputs([output], delta=delta).request_outputs
        assert result.num_cached_tokens == 32
    assert result.finished
