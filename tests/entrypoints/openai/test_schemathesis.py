"""Schemathesis over a live server's own /openapi.json: every documented operation (the generation, pooling and
tokenizer endpoints, /v1/models, /health, /version, /metrics) gets schema-derived cases from the examples, coverage
and fuzzing phases, with positive and negative data, a fixed seed and derandomized generation; each response must not
be a server error and must conform to the spec: a documented status code, content type and body schema. The
server and its spec are both under test: an undocumented answer fails as surely as a 500. At least MIN_CASES
cases run in all (printed with -s). /score and /rerank run against a server with a longer context (their prompts
do not fit the 48-token one), so that some of their cases score, at least MIN_SCORED of each."""
from __future__ import annotations

import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

SEED = 20250101
# Hypothesis examples per operation in the fuzzing phase (the coverage and examples phases add their own, and
# operations without parameters yield far fewer); enough for >= MIN_CASES cases in all.
FUZZING_EXAMPLES_PER_OPERATION = 150
MIN_CASES = 1000
SCORING_OPERATIONS = {"POST /score", "POST /rerank"}
SCORING_PATHS = "^/(score|rerank)$"
MIN_SCORED = 10  # cases of each scoring operation answered 200
EXPECTED_OPERATIONS = {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize",
                       "GET /v1/models", "GET /health", "GET /version", "GET /metrics", "GET /tokenizer_info",
                       "POST /v1/messages", "POST /v1/messages/count_tokens", "POST /v1/embeddings", "POST /score",
                       "POST /rerank", "POST /v1/responses", "GET /v1/responses/{response_id}",
                       "DELETE /v1/responses/{response_id}", "POST /v1/files", "GET /v1/files",
                       "GET /v1/files/{file_id}", "GET /v1/files/{file_id}/content", "DELETE /v1/files/{file_id}",
                       "POST /v1/batches", "GET /v1/batches", "GET /v1/batches/{batch_id}",
                       "POST /v1/batches/{batch_id}/cancel", "POST /v1/load_lora_adapter",
                       "POST /v1/unload_lora_adapter"}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# Generous: a fuzzed request on a 48-token context finishes in well under a second; this only stops a hang.
REQUEST_TIMEOUT_S = 30

cases_run: dict[str, int] = {}
cases_scored: dict[str, int] = {}


def fuzz_schema(server):
    config = schemathesis.Config.from_dict({
        "seed": SEED,
        "headers": {"Authorization": f"Bearer {server.api_key}"},
        "request-timeout": REQUEST_TIMEOUT_S,
        # Reports show the values sent: by default fields named like secrets ("*token*": max_tokens,
        # stop_token_ids...) are masked, and the API key is a test key.
        "output": {"sanitization": {"enabled": False}},
        # "all": positive and negative data. "none": no example database, so a run does not replay failures found
        # by an earlier one. No shrinking: once a case has killed the engine thread every later one is a 503, so
        # shrinking would end on an unrelated trivial case; the first failing case is the informative one.
        "generation": {"mode": "all", "deterministic": True, "database": "none", "no-shrink": True,
                       "max-examples": FUZZING_EXAMPLES_PER_OPERATION},
        # No stateful phase: the API has no links between operations, and it would only add time.
        "phases": {"examples": {"enabled": True}, "coverage": {"enabled": True}, "fuzzing": {"enabled": True},
                   "stateful": {"enabled": False}},
    })
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=config)


@pytest.fixture(scope="module")
def openapi_schema(fuzz_server):
    return fuzz_schema(fuzz_server)


@pytest.fixture(scope="module")
def scoring_openapi_schema(scoring_fuzz_server):
    return fuzz_schema(scoring_fuzz_server)


schema = schemathesis.pytest.from_fixture("openapi_schema").exclude(path_regex=SCORING_PATHS)
scoring_schema = schemathesis.pytest.from_fixture("scoring_openapi_schema").include(path_regex=SCORING_PATHS)


@pytest.fixture(autouse=True)
def _node_id_for_schemathesis(request):
    # schemathesis 4.x's lazy schemas read and rewrite `item._nodeid` to name each operation's subtest; pytest 9.2
    # keeps the id in `_id` instead and has no `_nodeid`. Seeding the attribute lets `from_fixture` run (the
    # renaming then only affects schemathesis' own messages; pytest's subtest reports still name the operation).
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


def test_spec_documents_every_endpoint(openapi_schema):
    labels = {result.ok().label for result in openapi_schema.get_all_operations()}
    assert EXPECTED_OPERATIONS <= labels


def run_case(case) -> None:
    label = case.operation.label
    cases_run[label] = cases_run.get(label, 0) + 1
    response = case.call_and_validate(checks=CHECKS)
    cases_scored[label] = cases_scored.get(label, 0) + (response.status_code == 200)


@schema.parametrize()
def test_every_operation_conforms_to_the_spec(case):
    run_case(case)


@scoring_schema.parametrize()
def test_scoring_operations_conform_to_the_spec(case):
    run_case(case)


def test_enough_cases_ran():
    # A test of the test: a spec or config change that starves generation must not pass quietly. (An operation
    # stops at its first failing case, so after failures above this count is low too: fix those first.)
    total = sum(cases_run.values())
    print(f"schemathesis cases per operation: {cases_run}; total {total}")
    assert set(cases_run) == EXPECTED_OPERATIONS
    assert total >= MIN_CASES, f"only {total} cases ran: {cases_run}"
    scored = {label: cases_scored[label] for label in SCORING_OPERATIONS}
    print(f"scoring cases answered 200: {scored}")
    assert min(scored.values()) >= MIN_SCORED, f"too few scoring cases reached a score: {scored}"
