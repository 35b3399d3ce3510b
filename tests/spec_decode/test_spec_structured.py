"""Speculative decoding under structured outputs (vLLM's way): a constrained request's draft is cut to the prefix
its grammar allows, each verified position is masked by its own bitmask row (the grammar after the drafts before
it), and the grammar advances over every token kept.

The pieces are checked against llguidance matchers this test builds on its own grammar text (independent of the
engine's conversion and mask plumbing); the engine end to end, on the tiny random-weight Llama (which samples all
over the vocabulary: the masks alone keep it in the language), against transformers' greedy decoding on the same
weights masked by such a matcher, against the engine without speculation, with drafts proposed, cut and accepted,
and with jsonschema on the finished JSON."""
from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from scheduler_factories import make_request, make_scheduler

from pagellm import LLM, SamplingParams
from pagellm.config import SpeculativeConfig, StructuredOutputsConfig
from pagellm.core.sched.output import GrammarOutput
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.spec_decode import adaptive
from pagellm.structured_output.backend_guidance import GuidanceBackend
from pagellm.structured_output.manager import LazyBackend, StructuredOutputManager
from pagellm.structured_output.request import StructuredOutputRequest
from pagellm.worker.input_batch import InputBatch, attach_grammar_bitmask
from pagellm.worker.sampling_inputs import build_sampling_tensors

VOCAB = 49152
EOS = 2
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SCHEMA = {"type": "array", "minItems": 3, "maxItems": 3,
          "items": {"type": "object", "additionalProperties": False, "required": ["id", "label"],
                    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                   "label": {"enum": ["alpha", "beta"]}}}}
EXAMPLE = '[{"id":1,"label":"alpha"},{"id":2,"label":"beta"},{"id":3,"label":"alpha"}]'
CHOICES = ["the quick brown fox jumps over", "a lazy dog sleeps all day long"]
REGEX = r"(item: [a-z]{2}; ){3}done"
# (constraint, the reference grammar text, a prompt that holds text the constraint repeats, so prompt lookup drafts)
CASES = {
    "json": (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
             llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False}),
             f"Example: {EXAMPLE}\nAnother one: "),
    "choice": (StructuredOutputsParams(choice=CHOICES),
               llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in CHOICES)),
               f"Say '{CHOICES[0]}' or '{CHOICES[1]}': "),
    "regex": (StructuredOutputsParams(regex=REGEX), llguidance.LLMatcher.grammar_from_regex(REGEX),
              "item: ab; item: cd; item: ef; done\nitem: "),
}


@pytest.fixture(autouse=True)
def fixed_draft_length(monkeypatch):
    """Every match drafts k tokens (the adaptive length follows this host's step times: see
    tests/entrypoints/test_llm_spec_decode.py)."""
    monkeypatch.setattr(adaptive, "best_length", lambda rate, max_k, *_: max_k)


@pytest.fixture(scope="module")
def backend(smollm2_tokenizer):
    return GuidanceBackend(smollm2_tokenizer, VOCAB, frozenset({EOS}), disable_additional_properties=True)


@pytest.fixture(scope="module")
def reference_tokenizer(smollm2_tokenizer):
    return llguidance.hf.from_tokenizer(smollm2_tokenizer, n_vocab=VOCAB, eos_token=EOS)


def reference_matcher(reference_tokenizer, grammar: str) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(reference_tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def allowed(matcher: llguidance.LLMatcher) -> np.ndarray:
    """The reference matcher's allowed tokens as a bool vector."""
    words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return np.unpackbits(words, bitorder="little")[:VOCAB].astype(bool)


def unpacked(row: np.ndarray) -> np.ndarray:
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB].astype(bool)


# ---- the grammar's draft rows and the draft's cut ---------------------------------------------------------------

def test_draft_rows_are_the_grammar_after_each_prefix(backend, smollm2_tokenizer, reference_tokenizer):
    params, grammar_text, _ = CASES["json"]
    grammar = backend.compile_grammar(params)
    draft = smollm2_tokenizer.encode(EXAMPLE[:20])
    bitmask = np.zeros((len(draft) + 3, VOCAB // 32), dtype=np.int32)
    grammar.fill_draft_bitmask(bitmask, 1, draft)
    assert not bitmask[0].any() and not bitmask[-1].any()  # only its own rows are written
    reference = reference_matcher(reference_tokenizer, grammar_text)
    for i in range(len(draft) + 1):
        assert np.array_equal(unpacked(bitmask[1 + i]), allowed(reference)), i
        if i < len(draft):
            assert reference.consume_token(draft[i])
    # The grammar is back where it started, and checks the tokens it accepts against those rows in order.
    start = np.zeros((1, VOCAB // 32), dtype=np.int32)
    grammar.fill_bitmask(start, 0)
    assert np.array_equal(start[0], bitmask[1])
    grammar.fill_draft_bitmask(bitmask, 1, draft)
    grammar.accept_tokens(draft[:2])
    wrong = int(np.flatnonzero(~unpacked(bitmask[3]))[0])
    with pytest.raises(RuntimeError, match="outside the grammar bitmask"):
        grammar.accept_tokens([wrong])


def test_a_draft_past_the_grammar_s_end_leaves_it_able_to_go_on(backend, smollm2_tokenizer):
    """llguidance takes EOS on a completed grammar without counting it as a token: the rows past the end repeat the
    end's row (EOS only), and the grammar still rolls back exactly."""
    grammar = backend.compile_grammar(StructuredOutputsParams(regex="(yes|no)"))
    yes, no = smollm2_tokenizer.encode("yes"), smollm2_tokenizer.encode("no")
    assert grammar.validate_tokens(yes + [EOS, EOS]) == len(yes) + 1
    bitmask = np.zeros((len(yes) + 2, VOCAB // 32), dtype=np.int32)
    grammar.fill_draft_bitmask(bitmask, 0, yes + [EOS])
    assert set(np.flatnonzero(unpacked(bitmask[len(yes)]))) == {EOS}
    assert np.array_equal(bitmask[len(yes) + 1], bitmask[len(yes)])
    assert grammar.validate_tokens(no) == len(no)  # not advanced, not in an error state
    grammar.accept_tokens(no)
    assert grammar.is_terminated()


def test_the_draft_is_cut_to_what_the_grammar_allows(backend, smollm2_tokenizer):
    structured = StructuredOutputRequest(StructuredOutputsParams(regex="(yes|no), (yes|no)\\."))
    structured.grammar = backend.compile_grammar(structured.params)
    valid = smollm2_tokenizer.encode("yes, no")
    assert structured.draft_length([], valid + smollm2_tokenizer.encode(", maybe")) == len(valid)
    assert structured.draft_length([], smollm2_tokenizer.encode("maybe")) == 0
    assert structured.draft_length([], valid[:1] + [-1] + valid[2:]) == 1  # a placeholder the worker fills
    # Inside reasoning nothing is checked, but the draft stops before the token that would close it.
    end = (50, 51)
    structured.reasoning_end = end
    assert structured.draft_length([9, 50], [51, 7]) == 0
    assert structured.draft_length([9], [7, 50, 51, 7]) == 2
    assert structured.draft_length([9], [7, 51, 50, 8]) == 4


# ---- the scheduler: the cut draft, its rows, and the tokens kept -------------------------------------------------

class Manager(StructuredOutputManager):
    def __init__(self, backend) -> None:
        class ModelConfig:
            vocab_size = VOCAB

        super().__init__(ModelConfig(), StructuredOutputsConfig())
        self._backend = LazyBackend(lambda: backend)


def test_the_scheduler_verifies_the_allowed_draft_under_a_row_per_position(backend, smollm2_tokenizer,
                                                                           reference_tokenizer):
    regex = "(yes|no)(, (yes|no))*\\."
    manager = Manager(backend)
    sched = make_scheduler(structured_output_manager=manager, max_model_len=128,
                           speculative_config=SpeculativeConfig(**SPEC))
    request = make_request("c", 4, params=SamplingParams(temperature=0.0, max_tokens=40,
                                                         structured_outputs=StructuredOutputsParams(regex=regex)))
    sched.add_request(request)
    manager.wait_for_any([request.structured_output_request], 10)
    yes, comma_no, dot = (smollm2_tokenizer.encode(text) for text in ("yes", ", no", "."))
    worker = InputBatch()
    out = sched.schedule()
    worker.update(out)
    sched.start_grammar_bitmask(out).result()
    sched.update_from_output(out, {"c": yes[:1]})
    drafts = iter([comma_no + smollm2_tokenizer.encode(" maybe") + comma_no, comma_no + dot + comma_no])
    sched.planner.drafter.proposer.draft = lambda token_ids, max_tokens=None: (next(drafts), 3)

    out = sched.schedule()
    assert out.scheduled[0].spec_token_ids == comma_no  # ", maybe" is not in the language
    rows = GrammarOutput.from_future(sched.start_grammar_bitmask(out)).grammar_bitmask
    reference = reference_matcher(reference_tokenizer, llguidance.LLMatcher.grammar_from_regex(regex))
    assert reference.consume_tokens(yes[:1])
    assert len(rows) == len(comma_no) + 1
    for i, row in enumerate(rows):
        assert np.array_equal(unpacked(row), allowed(reference)), i
        if i < len(comma_no):
            reference.consume_token(comma_no[i])
    # The worker masks each verified position (one logits row each, in order) with its own row.
    batch = worker.update(out)
    sampled = [batch[0]] * len(rows)
    attach_grammar_bitmask(sampled, out.structured_output_request_ids, rows)
    tensors = build_sampling_tensors(sampled, VOCAB, torch.device("cpu"))
    assert tensors.disallowed_tokens[0] is None
    assert np.array_equal(tensors.disallowed_tokens[1].numpy(), ~np.stack([unpacked(row) for row in rows]))
    with pytest.raises(RuntimeError, match="rows for the step's"):
        attach_grammar_bitmask(sampled, out.structured_output_request_ids, rows[:1])
    # The target kept the first draft token and sampled another after it: both advance the grammar.
    comma_yes = smollm2_tokenizer.encode(", yes")
    assert comma_yes[0] == comma_no[0] and comma_yes[1] != comma_no[1]
    sched.update_from_output(out, {"c": comma_yes + [7]})
    assert request.output_token_ids == yes[:1] + comma_yes

    out = sched.schedule()
    worker.update(out)
    assert out.scheduled[0].spec_token_ids == comma_no + dot  # nothing after the end
    rows = GrammarOutput.from_future(sched.start_grammar_bitmask(out)).grammar_bitmask
    assert set(np.flatnonzero(unpacked(rows[-1]))) == {EOS}
    _, finished = sched.update_from_output(out, {"c": comma_no + dot + [EOS]})
    assert [r.request_id for r in finished] == ["c"] and request.finish_reason == "stop"
    assert smollm2_tokenizer.decode(request.output_token_ids) == "yes, yes, no."
    stats = sched.spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 4)
    assert not sched.has_unfinished_requests()
    sched.check_consistency()


# ---- end to end on the tiny model -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("llama")
    return model_dir, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_constrained_greedy(model, prompt_ids: list[int], matcher: llguidance.LLMatcher, max_tokens: int) -> list[int]:
    """transformers' greedy decoding with each step's logits masked by `matcher` (advanced over each token),
    until the grammar ends (then only EOS is allowed, which is not part of the engine's output)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Mask(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] > len(prompt_ids):
                assert matcher.consume_token(int(input_ids[0, -1])), matcher.get_error()
            return scores.masked_fill(~torch.from_numpy(allowed(matcher)), float("-inf"))

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                             logits_processor=LogitsProcessorList([Mask()]), eos_token_id=EOS, pad_token_id=0)
    tokens = out[0, len(prompt_ids):].tolist()
    return tokens[:-1] if tokens and tokens[-1] == EOS else tokens


def check_in_language(reference_tokenizer, case: str, token_ids: list[int], text: str, finished: bool) -> None:
    """Every token allowed at its position by a reference matcher, and a finished output that satisfies the
    constraint by an independent check."""
    _, grammar_text, _ = CASES[case]
    matcher = reference_matcher(reference_tokenizer, grammar_text)
    for step, token in enumerate(token_ids):
        assert allowed(matcher)[token], (step, token, token_ids)
        assert matcher.consume_token(token), matcher.get_error()
    if not finished:
        return
    assert matcher.is_accepting(), text
    if case == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif case == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(REGEX, text), text


def make_llm(model_dir, spec: bool, **kwargs) -> LLM:
    return LLM(model=str(model_dir), max_model_len=256, block_size=16, kv_cache_memory_bytes=8 << 20,
               speculative_config=dict(SPEC) if spec else None, **kwargs)


def run(llm: LLM, smollm2_tokenizer, **sampling) -> list:
    prompts = [{"prompt_token_ids": smollm2_tokenizer.encode(prompt)} for _, _, prompt in CASES.values()]
    params = [SamplingParams(max_tokens=60, structured_outputs=constraint, **sampling)
              for constraint, _, _ in CASES.values()]
    # An unconstrained request in the same batch: its rows sit between the constrained ones'.
    prompts.insert(1, prompts[0])
    params.insert(1, SamplingParams(max_tokens=30, ignore_eos=True, **sampling))
    return llm.generate(prompts, params, use_tqdm=False)


def token_ids(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def test_greedy_matches_masked_transformers_and_no_speculation(tiny, smollm2_tokenizer, reference_tokenizer,
                                                               monkeypatch):
    model_dir, hf = tiny
    cuts = []
    draft_length = StructuredOutputRequest.draft_length

    def recorded(self, output_token_ids, draft):
        cuts.append((len(draft), draft_length(self, output_token_ids, draft)))
        return cuts[-1][1]

    monkeypatch.setattr(StructuredOutputRequest, "draft_length", recorded)
    llm = make_llm(model_dir, spec=True)
    outputs = run(llm, smollm2_tokenizer, temperature=0.0)
    assert token_ids(outputs) == token_ids(run(make_llm(model_dir, spec=False), smollm2_tokenizer, temperature=0.0))
    for (case, (_, grammar_text, prompt)), output in zip(CASES.items(), outputs[:1] + outputs[2:]):
        completion = output.outputs[0]
        expected = hf_constrained_greedy(hf, smollm2_tokenizer.encode(prompt), reference_matcher(reference_tokenizer,
                                                                                         grammar_text), 60)
        assert list(completion.token_ids) == expected, case
        assert completion.finish_reason == "stop", (case, completion.text)
        check_in_language(reference_tokenizer, case, list(completion.token_ids), completion.text, finished=True)
    stats = llm.llm_engine.engine_core.scheduler.spec_decoding_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert any(kept < proposed for proposed, kept in cuts), "no draft reached past what its grammar allows"
    assert any(kept > 0 for _, kept in cuts)
    llm.llm_engine.engine_core.scheduler.check_consistency()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_seeded_sampling_stays_in_the_language_and_matches_no_speculation(tiny, smollm2_tokenizer, reference_tokenizer,
                                                                          async_scheduling):
    """Seeded rows draw by output position (worker/sampling_inputs.py), so a seeded request gets the same tokens
    with speculation as without; n = 2 forks the grammar at the first sample, then each sequence speculates. With
    async scheduling too (compared with the synchronous engine without speculation): drafting sequences wait for
    their batch, the others' bitmasks follow their blind tokens."""
    model_dir, _ = tiny
    llm = make_llm(model_dir, spec=True, async_scheduling=async_scheduling)
    sampling = dict(temperature=0.8, seed=5, n=2)
    outputs = run(llm, smollm2_tokenizer, **sampling)
    base = make_llm(model_dir, spec=False)
    assert token_ids(outputs) == token_ids(run(base, smollm2_tokenizer, **sampling))
    for case, output in zip(CASES, outputs[:1] + outputs[2:]):
        for completion in output.outputs:
            check_in_language(reference_tokenizer, case, list(completion.token_ids), completion.text,
                              finished=completion.finish_reason == "stop")
    stats = llm.llm_engine.engine_core.scheduler.spec_decoding_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    llm.llm_engine.engine_core.scheduler.check_consistency()


def test_after_reasoning_the_grammar_s_drafts_are_verified(qwen3_thinking_dir):
    """With a reasoning parser the grammar starts after `</think>` (forced first here by a logit bias): the
    content's drafts, copied from an earlier answer in the prompt, are cut to the grammar and verified under it."""
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(str(qwen3_thinking_dir))
    end = hf_tokenizer.convert_tokens_to_ids("</think>")
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "n"],
              "properties": {"city": {"enum": ["Paris", "Lima"]}, "n": {"type": "integer", "minimum": 0,
                                                                         "maximum": 9}}}
    turn = "<|im_start|>user\nGive me a JSON object.<|im_end|>\n<|im_start|>assistant\n"
    prompt = turn + '<think>\nok\n</think>\n\n{"city":"Paris","n":7}<|im_end|>\n' + turn + "<think>\n"
    params = SamplingParams(temperature=0.0, max_tokens=40, logit_bias={end: 100},
                            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    outputs = []
    for spec in (True, False):
        llm = LLM(model=str(qwen3_thinking_dir), reasoning_parser="qwen3", kv_cache_memory_bytes=8 << 20,
                  max_model_len=256, speculative_config=dict(SPEC) if spec else None)
        outputs.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0])
        if spec:
            stats = llm.llm_engine.engine_core.scheduler.spec_decoding_stats
            assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert list(outputs[0].token_ids) == list(outputs[1].token_ids)
    tokens = list(outputs[0].token_ids)
    assert tokens[0] == end and outputs[0].finish_reason == "stop"
    matcher = reference_matcher(llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=len(hf_tokenizer), eos_token=EOS),
                                llguidance.LLMatcher.grammar_from_json_schema(
                                    schema, defaults={"whitespace_flexible": False}))
    for token in tokens[1:]:
        assert matcher.consume_token(token), matcher.get_error()
    jsonschema.validate(json.loads(outputs[0].text.partition("</think>")[2]), schema)
