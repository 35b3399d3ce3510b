"""The structured-output guarantee, as a property: for generated JSON schemas, regexes, choice lists and Lark
grammars (oversized ones included), a constrained generation through the whole engine either
- gives tokens that were each allowed at their position by a matcher this test builds itself (llguidance on its
  own grammar text, with generous limits: independent of the engine's grammar conversion, limits and mask
  plumbing), and a finished text that satisfies the constraint by an independent check (json + jsonschema,
  Python's re, list membership), or
- is refused with an InvalidRequestError naming a grammar limit (before queueing, or failing alone mid-generation),
  or, mid-generation, saying that no token of the model spells what the grammar needs next (SmolLM2's vocabulary
  has no token for some bytes, such as 0x04 or 0xF1, the first byte of U+40000-U+7FFFF; llguidance's own mask
  then allows tokens that do not spell it, which the engine must catch).
Never a token outside the grammar, and never any other failure. Runs on the tiny random-weight Llama, which
samples all over the vocabulary: the mask alone keeps it in the language."""
from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm import LLM, InvalidRequestError, RequestFailedError, SamplingParams
from pagellm.sampling_params import StructuredOutputsParams

VOCAB = 49152
EOS = 2
MAX_TOKENS = 40
PROMPT = {"prompt_token_ids": [5, 17, 100, 42]}
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# The reference matcher's limits: far above the engine's, so that a constraint the engine ran is one it can check.
REFUSAL = re.compile(r"grammar limit|cannot be continued")
REFERENCE_LIMITS = dict(max_items_in_row=1_000_000, step_max_items=10_000_000, step_lexer_fuel=100_000_000,
                        initial_lexer_fuel=100_000_000, max_lexer_states=10_000_000, max_grammar_size=10_000_000)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def llm(model_dir, request):
    """Both step loops: with async scheduling a constrained batch's bitmask waits for the step before it."""
    return LLM(model=str(model_dir), max_model_len=128, kv_cache_memory_bytes=8 << 20, async_scheduling=request.param)


@pytest.fixture(scope="module")
def reference_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(str(smollm2_dir)), n_vocab=VOCAB,
                                        eos_token=EOS)


def check_generation(llm, reference_tokenizer, params: StructuredOutputsParams, reference_grammar: str,
                     satisfied, temperature: float) -> None:
    sampling = SamplingParams(temperature=temperature, seed=11, n=2, max_tokens=MAX_TOKENS, structured_outputs=params)
    try:
        outputs = llm.generate([PROMPT], sampling, use_tqdm=False)
    except InvalidRequestError as exc:  # refused before queueing
        assert REFUSAL.search(str(exc)), exc
        return
    except RequestFailedError as exc:  # a limit met mid-generation: the request fails alone, naming it
        assert all(reason.startswith("InvalidRequestError: ") and REFUSAL.search(reason)
                   for reason in exc.errors.values()), exc.errors
        return
    for completion in outputs[0].outputs:
        matcher = llguidance.LLMatcher(reference_tokenizer, reference_grammar, log_level=0,
                                       limits=llguidance.LLParserLimits(**REFERENCE_LIMITS))
        assert not matcher.is_error(), matcher.get_error()
        for step, token in enumerate(completion.token_ids):
            mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
            assert (int(mask[token // 32]) >> (token % 32)) & 1, (step, token, completion.token_ids)
            if token == EOS:
                break
            assert matcher.consume_token(token), matcher.get_error()
        if completion.finish_reason == "stop":
            assert matcher.is_accepting(), completion.text
            assert satisfied(completion.text), completion.text


# ---- regexes (and the Lark grammars built from the same trees) -------------------------------------------------
# A tree: ("lit", str) | ("class", str) | ("seq", [trees]) | ("alt", [trees]) | ("rep", tree, low, high)
_LITERALS = st.text(alphabet="abcxyz019 -_.:", min_size=1, max_size=4)
_CLASSES = st.sampled_from(["a-z", "0-9", "A-F", "a-c0-2"])
_LEAVES = st.one_of(_LITERALS.map(lambda s: ("lit", s)), _CLASSES.map(lambda c: ("class", c)))
_COUNTS = st.one_of(st.integers(0, 3), st.sampled_from([50, 5_000, 1_000_000]))


def _rep(child):
    return st.tuples(st.just("rep"), child, st.integers(0, 2), _COUNTS).map(
        lambda t: (t[0], t[1], t[2], max(t[2], t[3], 1)))


TREES = st.recursive(_LEAVES, lambda child: st.one_of(
    st.lists(child, min_size=2, max_size=3).map(lambda c: ("seq", c)),
    st.lists(child, min_size=2, max_size=3).map(lambda c: ("alt", c)),
    _rep(child)), max_leaves=6)


def to_regex(tree) -> str:
    kind = tree[0]
    if kind == "lit":
        return re.escape(tree[1])
    if kind == "class":
        return f"[{tree[1]}]"
    if kind == "seq":
        return "".join(f"(?:{to_regex(c)})" for c in tree[1])
    if kind == "alt":
        return "(?:" + "|".join(to_regex(c) for c in tree[1]) + ")"
    return f"(?:{to_regex(tree[1])}){{{tree[2]},{tree[3]}}}"


def to_lark(tree, rules: list[str]) -> str:
    """The tree as a Lark expression; a repetition is a rule of `low` copies and then optional ones, up to 3 in
    all (Lark has no counted repetition; the final text is checked against the regex with its counts capped)."""
    kind = tree[0]
    if kind == "lit":
        return json.dumps(tree[1])
    if kind == "class":
        return f"/[{tree[1]}]/"
    if kind == "seq":
        return " ".join(f"({to_lark(c, rules)})" for c in tree[1])
    if kind == "alt":
        return "(" + " | ".join(to_lark(c, rules) for c in tree[1]) + ")"
    _, child, low, high = tree
    body = to_lark(child, rules)
    name = f"r{len(rules)}"
    rules.append(f"{name}: " + " ".join([f"({body})"] * low + [f"({body})?"] * (min(high, 3) - low)))
    return name


@SETTINGS
@given(tree=TREES, temperature=st.sampled_from([0.0, 1.0]))
def test_regexes(llm, reference_tokenizer, tree, temperature):
    pattern = to_regex(tree)
    check_generation(llm, reference_tokenizer, StructuredOutputsParams(regex=pattern),
                     llguidance.LLMatcher.grammar_from_regex(pattern),
                     lambda text: re.fullmatch(pattern, text) is not None, temperature)


@SETTINGS
@given(tree=TREES, temperature=st.sampled_from([0.0, 1.0]))
def test_lark_grammars(llm, reference_tokenizer, tree, temperature):
    rules: list[str] = []
    start = to_lark(tree, rules)
    grammar = "\n".join([f"start: {start}"] + rules)
    capped = re.sub(r"\{(\d+),(\d+)\}", lambda m: f"{{{min(int(m[1]), 3)},{min(int(m[2]), 3)}}}", to_regex(tree))
    check_generation(llm, reference_tokenizer, StructuredOutputsParams(grammar=grammar),
                     llguidance.LLMatcher.grammar_from_lark(grammar),
                     lambda text: re.fullmatch(capped, text) is not None, temperature)


# ---- choices -----------------------------------------------------------------------------------------------------
CHOICES = st.one_of(
    st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=8, unique=True),
    st.integers(500, 5_000).map(lambda n: [f"option {i:05d}" for i in range(n)]),  # thousands of choices
)


@SETTINGS
@given(choices=CHOICES, temperature=st.sampled_from([0.0, 1.0]))
def test_choices(llm, reference_tokenizer, choices, temperature):
    reference = "start: " + " | ".join(json.dumps(c) for c in choices)  # parser alternatives, not the engine's lexeme
    check_generation(llm, reference_tokenizer, StructuredOutputsParams(choice=choices),
                     llguidance.LLMatcher.grammar_from_lark(reference), lambda text: text in choices, temperature)


# ---- JSON schemas ------------------------------------------------------------------------------------------------
_SCALARS = st.one_of(
    st.integers(0, 50).map(lambda n: {"type": "string", "maxLength": n % 6}),
    st.tuples(st.integers(-99, 99), st.integers(0, 99)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.just({"type": "boolean"}),
    st.lists(st.text(alphabet="abc XYZ", min_size=1, max_size=5), min_size=1, max_size=4, unique=True).map(
        lambda values: {"enum": values}),
    st.integers(2_000, 4_000).map(lambda n: {"enum": [f"v{i}" for i in range(n)]}),  # a large enum
)


def _object(children):
    return st.dictionaries(st.text(alphabet="abcdefgh_", min_size=1, max_size=6), children, min_size=1,
                           max_size=4).map(lambda props: {"type": "object", "properties": props,
                                                          "required": sorted(props), "additionalProperties": False})


SCHEMAS = st.recursive(_SCALARS, lambda child: st.one_of(
    _object(child),
    child.map(lambda items: {"type": "array", "items": items, "maxItems": 2})), max_leaves=5)


@SETTINGS
@given(schema=SCHEMAS, temperature=st.sampled_from([0.0, 1.0]))
def test_json_schemas(llm, reference_tokenizer, schema, temperature):
    def satisfied(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    check_generation(llm, reference_tokenizer, StructuredOutputsParams(json=schema, disable_any_whitespace=True),
                     llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False}),
                     satisfied, temperature)
