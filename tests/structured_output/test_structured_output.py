"""The structured-output pieces on their own: the llguidance backend's bitmask against the vocabulary (an
independent check: which tokens' text can start a choice), the unpacking the workers do, the bitmask's trip in a
pickled GrammarOutput beside its pickled SchedulerOutput to a worker's batch, and the scheduler around a grammar
that is still compiling (it waits without holding up other requests; n > 1 forks the grammar; a finished grammar
stops the sequence)."""
from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest
import torch
from scheduler_factories import make_request, make_scheduler

from pagellm.config import StructuredOutputsConfig
from pagellm.core.request import RequestStatus
from pagellm.core.sched.output import GrammarOutput
from pagellm.exceptions import InvalidRequestError
from pagellm.model_executor.layers.logits_processors import mask_disallowed, unpack_disallowed
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.structured_output.backend_guidance import GuidanceBackend
from pagellm.structured_output.json_schema import close_objects
from pagellm.structured_output.manager import LazyBackend, StructuredOutputManager
from pagellm.worker.input_batch import InputBatch, attach_grammar_bitmask

VOCAB = 49152
EOS = 2
CHOICES = ["yes please", "no"]


@pytest.fixture(scope="module")
def backend(smollm2_tokenizer):
    return GuidanceBackend(smollm2_tokenizer, VOCAB, frozenset({EOS}), disable_additional_properties=True)


def allowed_ids(bitmask_row: np.ndarray) -> set[int]:
    """Bit t % 32 of word t // 32, read one token at a time (the slow, obvious way)."""
    return {t for t in range(VOCAB) if (int(bitmask_row[t // 32]) >> (t % 32)) & 1}


def test_choice_bitmask_is_every_token_that_can_start_a_choice(backend, smollm2_tokenizer):
    grammar = backend.compile_grammar(StructuredOutputsParams(choice=CHOICES))
    bitmask = np.zeros((2, VOCAB // 32), dtype=np.int32)
    grammar.fill_bitmask(bitmask, 1)
    assert not bitmask[0].any()
    texts = {t: smollm2_tokenizer.decode([t]) for t in range(VOCAB)
             if not smollm2_tokenizer.convert_ids_to_tokens(t).startswith("<")}
    expected = {t for t, text in texts.items() if text and any(c.startswith(text) for c in CHOICES)}
    assert allowed_ids(bitmask[1]) == expected
    # Walk "no" to its end: then only EOS may follow, and the grammar has terminated.
    grammar.accept_tokens(smollm2_tokenizer.encode("no"))
    assert grammar.is_terminated()
    grammar.fill_bitmask(bitmask, 0)
    assert allowed_ids(bitmask[0]) == {EOS}
    with pytest.raises(RuntimeError, match="outside the grammar bitmask"):
        grammar.accept_tokens(smollm2_tokenizer.encode("x"))


def test_fork_is_independent(backend, smollm2_tokenizer):
    grammar = backend.compile_grammar(StructuredOutputsParams(regex="(ab|cd)e"))
    fork = grammar.fork()
    grammar.accept_tokens(smollm2_tokenizer.encode("ab"))
    fork.accept_tokens(smollm2_tokenizer.encode("cd"))
    grammar.accept_tokens(smollm2_tokenizer.encode("e"))
    assert grammar.is_terminated()
    assert not fork.is_terminated()


def walk(grammar, tokens: list[int]) -> None:
    """Sample `tokens` one at a time as the engine does: a bitmask filled before each, then the token accepted."""
    bitmask = np.zeros((1, VOCAB // 32), dtype=np.int32)
    for token in tokens:
        grammar.fill_bitmask(bitmask, 0)
        grammar.accept_tokens([token])


def test_close_objects_closes_exactly_the_objects_that_name_their_properties():
    item = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {
        "type": "object",
        "properties": {"items": {"type": "array", "items": item},
                       # A property called "properties" is a property, not a keyword.
                       "properties": {"type": "object", "properties": {"a": {}}},
                       "open": {"type": "object", "properties": {"b": {}}, "additionalProperties": True},
                       "any": {"type": "object"}},
        "$defs": {"d": {"properties": {"c": {}}}},
        "anyOf": [{"properties": {"e": {}}}],
        "allOf": [{"properties": {"f": {}}}],  # a part of the object: the other parts name the rest
    }
    closed = close_objects(schema)
    assert "additionalProperties" not in schema["properties"]["items"]["items"]  # the input is not changed
    props = closed["properties"]
    assert "additionalProperties" not in closed  # it has anyOf / allOf beside its properties
    assert props["items"]["items"]["additionalProperties"] is False
    assert props["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in props["properties"]["properties"]
    assert props["open"]["additionalProperties"] is True
    assert "additionalProperties" not in props["any"]
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in closed["allOf"][0]


@pytest.mark.parametrize("strict", [None, True, False])
def test_json_objects_admit_unnamed_keys_only_when_asked(backend, smollm2_tokenizer, strict):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    grammar = backend.compile_grammar(StructuredOutputsParams(json=schema, disable_any_whitespace=True,
                                                              disable_additional_properties=strict))
    extra = smollm2_tokenizer.encode('{"city":"Lyon","unit":"c"}')
    if strict is False:
        walk(grammar, extra)
    else:  # None: the backend's default (on)
        with pytest.raises(RuntimeError, match="outside the grammar bitmask"):
            walk(grammar, extra)


def test_a_constraint_too_large_for_its_limits_is_refused_before_queueing(backend):
    with pytest.raises(InvalidRequestError, match="structured_outputs.regex exceeds a grammar limit.*simplify"):
        backend.validate(StructuredOutputsParams(regex="a{1000000}"))


def test_thousands_of_choices_are_one_lexeme(backend, smollm2_tokenizer):
    """5,000 choices would be 5,000 Earley items in one row as parser alternatives (over the 2,000 limit)."""
    rng = np.random.default_rng(0)
    choices = sorted({"".join(rng.choice(list("abcdefgh "), size=rng.integers(3, 12))) for _ in range(5000)})
    params = StructuredOutputsParams(choice=choices)
    backend.validate(params)
    target = choices[1234]
    grammar = backend.compile_grammar(params)
    walk(grammar, smollm2_tokenizer.encode(target))
    assert grammar.is_terminated()


def test_a_limit_met_mid_generation_is_the_requests_error(backend, smollm2_tokenizer):
    """The probe passes (its first tokens are digits), the lexer's limit is met at the first 'z': the token was
    allowed by the mask, so the error names the limit instead of calling the token forbidden."""
    params = StructuredOutputsParams(regex="[0-9]{30}z{1000000}")
    backend.validate(params)
    grammar = backend.compile_grammar(params)
    walk(grammar, smollm2_tokenizer.encode("0" * 30))
    with pytest.raises(InvalidRequestError, match="exceeded a grammar limit during generation"):
        walk(grammar, smollm2_tokenizer.encode("zzzz"))


def test_unpack_and_mask_match_a_per_bit_reference():
    rng = np.random.default_rng(0)
    rows = [rng.integers(-2**31, 2**31, size=VOCAB // 32, dtype=np.int64).astype(np.int32) for _ in range(3)]
    disallowed = unpack_disallowed(rows, VOCAB)
    for row, unpacked in zip(rows, disallowed):
        assert set(torch.nonzero(~unpacked).flatten().tolist()) == allowed_ids(row)
    logits = torch.randn(5, VOCAB)
    out = mask_disallowed(logits.clone(), torch.tensor([0, 3, 4]), disallowed)
    for out_row, in_row, mask in zip(out[[0, 3, 4]], logits[[0, 3, 4]], disallowed):
        assert torch.equal(out_row, in_row.masked_fill(mask, float("-inf")))
    assert torch.equal(out[[1, 2]], logits[[1, 2]])
    assert torch.equal(mask_disallowed(logits[:3].clone(), None, disallowed), logits[:3].masked_fill(
        disallowed, float("-inf")))


def test_a_bitmask_narrower_than_the_logits_is_refused():
    """Padding rows of an LM head beyond the bitmask's bits must not come out allowed."""
    with pytest.raises(ValueError, match="cannot cover"):
        unpack_disallowed([np.full(VOCAB // 32, -1, dtype=np.int32)], VOCAB + 64)


class SlowManager(StructuredOutputManager):
    """Compiles only once `release` is set, so the test sees a request waiting for its grammar."""

    def __init__(self, model_config, backend) -> None:
        super().__init__(model_config, StructuredOutputsConfig())
        self._backend = LazyBackend(lambda: backend)
        self.release = threading.Event()

    def _compile(self, params):
        self.release.wait(10)
        return super()._compile(params)


class _ModelConfig:
    vocab_size = VOCAB


def test_scheduler_waits_for_the_grammar_without_holding_up_others(backend, smollm2_tokenizer):
    manager = SlowManager(_ModelConfig(), backend)
    sched = make_scheduler(structured_output_manager=manager)
    constrained = make_request("c", 3, params=SamplingParams(n=2, temperature=1.0, max_tokens=10,
                                                   structured_outputs=StructuredOutputsParams(choice=CHOICES)))
    free = make_request("f", 3, params=SamplingParams(temperature=0.0, max_tokens=10))
    sched.add_request(constrained)
    sched.add_request(free)
    worker = InputBatch()
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["f"] and not out.structured_output_request_ids
    assert sched.start_grammar_bitmask(out) is None  # nothing to compute, nothing to send
    assert constrained.status == RequestStatus.WAITING_FOR_FSM and sched.has_unfinished_requests()
    sched.check_consistency()
    worker.update(out)
    sched.update_from_output(out, {"f": [7]})

    manager.release.set()
    manager.wait_for_any([constrained.structured_output_request], 10)
    out = sched.schedule()
    grammar = GrammarOutput.from_future(sched.start_grammar_bitmask(out))
    out, grammar = pickle.loads(pickle.dumps((out, grammar)))  # what a worker process receives
    assert [s.request_id for s in out.scheduled] == ["f", "c"]
    assert out.structured_output_request_ids == ["c"] and grammar.error is None
    batch = worker.update(out)
    attach_grammar_bitmask(batch, out.structured_output_request_ids, grammar.grammar_bitmask)
    batch = {r.request_id: r for r in batch}
    assert batch["f"].grammar_bitmask is None
    assert allowed_ids(batch["c"].grammar_bitmask[0]) == allowed_ids(grammar.grammar_bitmask[0])
    assert smollm2_tokenizer.encode("no")[0] in allowed_ids(batch["c"].grammar_bitmask[0])

    # n = 2: the two sequences take different choices, each with its own grammar; "no" completes at once.
    yes, no = smollm2_tokenizer.encode("yes"), smollm2_tokenizer.encode("no")
    _, finished = sched.update_from_output(out, {"f": [7], "c": [yes[0], no[0]]})
    assert [(r.request_id, r.finish_reason) for r in finished] == [("c/1", "stop")]
    out = sched.schedule()
    assert out.structured_output_request_ids == ["c"]
    rest = CHOICES[0][len(smollm2_tokenizer.decode(yes[:1])):]
    allowed = allowed_ids(sched.start_grammar_bitmask(out).result()[0])
    assert allowed and all(rest.startswith(smollm2_tokenizer.decode([t])) for t in allowed)
    sched.abort_requests(["c", "f"])
    assert not sched.has_unfinished_requests()
    sched.check_consistency()


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(backend):
    class FailingManager(StructuredOutputManager):
        def _compile(self, params):
            raise ValueError("no such grammar")

    manager = FailingManager(_ModelConfig(), StructuredOutputsConfig())
    sched = make_scheduler(structured_output_manager=manager)
    request = make_request("c", 3, params=SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))
    sched.add_request(request)
    manager.wait_for_any([request.structured_output_request], 10)
    assert sched.schedule().is_empty
    assert sched.take_failed_groups() == {"c": "ValueError: no such grammar"}
    assert not sched.has_unfinished_requests()
    # The failed compilation is cached like any other: the same text fails again without a second compile.
    again = make_request("d", 3, params=SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))
    manager.grammar_init(again.structured_output_request)
    assert again.structured_output_request.compiled is request.structured_output_request.compiled is not None


def test_other_parameters_cannot_push_a_row_out_of_its_grammar():
    """An overflowing repetition penalty makes every allowed logit -inf and min_tokens bans the one allowed token:
    the constrained rows still sample an allowed token (their most likely one), the free row is left alone."""
    from pagellm.model_executor.layers.sampler import Sampler, SamplingTensors

    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, 5], logits[0, 9] = -1.0, -0.5  # negative: an infinite repetition penalty makes them -inf
    allowed = [torch.tensor([5, 9]), torch.tensor([2])]
    disallowed = torch.ones(2, vocab, dtype=torch.bool)
    for row, ids in enumerate(allowed):
        disallowed[row, ids] = False
    tensors = SamplingTensors(
        temperature=torch.tensor([0.0, 1.0, 0.0]), top_p=torch.ones(3), top_k=torch.full((3,), vocab),
        all_greedy=False, needs_top_k=False, needs_top_p=False, generators={}, num_logprobs=[None] * 3,
        repetition_penalty=torch.tensor([float("inf"), 1.0, 1.0]), frequency_penalty=torch.zeros(3),
        presence_penalty=torch.zeros(3), prompt_tokens=torch.arange(vocab).repeat(3, 1),
        output_tokens=torch.full((3, 1), vocab), bans=(torch.tensor([1]), torch.tensor([2])),
        disallowed_tokens=(torch.tensor([0, 1]), disallowed))
    tokens = Sampler()(logits.clone(), tensors).sampled.tolist()
    assert tokens[0] == 9
    assert tokens[1] == 2
    assert tokens[2] == int(logits[2].argmax())


def test_a_compilation_spent_by_a_limit_is_compiled_afresh(backend, smollm2_tokenizer):
    """llguidance's copies of one compiled grammar share its lexer's state budget: after one request met the limit,
    the next gets a new compilation instead of failing at once."""
    from pagellm.structured_output.request import StructuredOutputRequest

    manager = StructuredOutputManager(_ModelConfig(), StructuredOutputsConfig())
    manager._backend = LazyBackend(lambda: backend)
    params = StructuredOutputsParams(regex="[0-9]{30}z{1000000}")
    first, again, fresh = (StructuredOutputRequest(params) for _ in range(3))
    manager.grammar_init(first)
    manager.grammar_init(again)
    assert again.compiled is first.compiled  # shared while unspent
    first.compiled.result(10)
    first.take_grammar()
    walk(first.grammar, smollm2_tokenizer.encode("0" * 30))
    with pytest.raises(InvalidRequestError):
        walk(first.grammar, smollm2_tokenizer.encode("zz"))
    manager.grammar_init(fresh)
    assert fresh.compiled is not first.compiled
    fresh.compiled.result(10)
    fresh.take_grammar()
    walk(fresh.grammar, smollm2_tokenizer.encode("0" * 30))
    manager.shutdown()
