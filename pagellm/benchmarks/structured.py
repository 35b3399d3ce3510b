"""`pagellm bench structured`: what a JSON-schema constraint costs, and whether its outputs are valid.

1. Time per output token with and without a constraint, at each `--batch-sizes`: the engine is stepped by hand and
   the decode steps (every sequence running, none finished) are timed, the two runs alternating `--rounds` times
   (a shared machine's noise then hits both alike), and the medians compared. The constraint is an array of at least
   `--min-items` objects, so both runs generate exactly `--output-len` tokens; the grammar's share of a step
   (bitmask, computed during the forward pass on a thread of its own; unpacking, masking, advancing the matchers)
   is what differs.
2. First-request latency (time to the first token of one request): unconstrained; constrained on a fresh engine
   (llguidance's view of the tokenizer is built, then the grammar compiled); a new schema (compile only); the same
   schema again (cached).
3. Validity: `--num-per-schema` sampled objects for each of 5 schemas (nested objects, arrays, enums, bounded
   numbers, required fields; strict, as OpenAI's strict mode requires: no undeclared properties), each parsed
   with `json` and validated with `jsonschema`.

`--workload tools` measures tool calls instead (see structured_tools.py).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pagellm.benchmarks import structured_tools
from pagellm.benchmarks.machine import machine_header
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams

_NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SCHEMAS = {
    "nested object": {"type": "object", "properties": {
        "name": _NAME, "address": {"type": "object", "properties": {"street": _NAME, "city": _NAME, "zip": {
            "type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "city", "zip"]}},
        "required": ["name", "address"]},
    "array": {"type": "object", "properties": {"tags": {"type": "array", "items": _NAME, "minItems": 1,
                                                        "maxItems": 5}},
              "required": ["tags"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"enum": ["S", "M", "L", "XL"]}},
             "required": ["color", "size"]},
    "bounded numbers": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                                         "score": {"type": "number", "minimum": 0, "maximum": 1}},
                        "required": ["age", "score"]},
    "required fields": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 10**6},
                                                         "title": _NAME, "done": {"type": "boolean"},
                                                         "note": _NAME},
                        "required": ["id", "title", "done"]},
}


def _strict(schema: dict) -> dict:
    """OpenAI's strict mode: no properties beyond the listed ones on any object (without it a model may add keys
    with strings of any length and run out of tokens)."""
    if schema.get("type") == "object":
        schema = {**schema, "additionalProperties": False,
                  "properties": {k: _strict(v) for k, v in schema["properties"].items()}}
    return schema


SCHEMAS = {name: _strict(schema) for name, schema in SCHEMAS.items()}
PROMPTS = {
    "nested object": "Give a person's name and postal address as JSON.",
    "array": "List a few tags for a photo of a beach as JSON.",
    "enum": "Describe a T-shirt's color and size as JSON.",
    "bounded numbers": "Give an age and a score between 0 and 1 as JSON.",
    "required fields": "Describe a to-do item as JSON.",
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=["schemas", "tools"], default="schemas",
                        help="schemas: the cost and validity of JSON-schema constraints; tools: the validity of "
                             'tool_choice "required" calls')
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--min-items", type=int, default=50, help="array length that keeps the constraint running")
    parser.add_argument("--rounds", type=int, default=3, help="alternating unconstrained / constrained runs")
    parser.add_argument("--num-per-schema", type=int, default=10)
    parser.add_argument("--dataset-seed", type=int, default=0)
    structured_tools.add_cli_args(parser)


def _decode_step_ms(engine: LLMEngine, prompts: list[dict], params: SamplingParams) -> list[float]:
    """Times (ms) of the steps in which every sequence decodes."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"tpot-{time.monotonic_ns()}-{i}", prompt, params)
    scheduler = engine.engine_core.scheduler
    times = []
    while engine.has_unfinished_requests():
        all_decoding = len(scheduler.running) == len(prompts) and all(
            r.num_computed_tokens == r.num_tokens - 1 and r.num_output_tokens for r in scheduler.running)
        start = time.perf_counter()
        engine.step()
        if all_decoding:
            times.append(1000 * (time.perf_counter() - start))
    return times


def _first_token_s(engine: LLMEngine, prompt: dict, params: SamplingParams) -> float:
    start = time.perf_counter()
    engine.add_request(f"ttft-{time.monotonic_ns()}", prompt, params)
    while engine.has_unfinished_requests():
        outputs, _ = engine.step_outputs()
        if any(o.outputs and o.outputs[0].token_ids for o in outputs):
            break
    elapsed = time.perf_counter() - start
    engine.abort_request([r for r in engine.engine_core.scheduler.groups])
    return elapsed


def _item_schema(min_items: int) -> dict:
    item = {"type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0,
                                                                     "maximum": 120}},
            "required": ["name", "age"]}
    return {"type": "array", "items": item, "minItems": min_items}


def measure_overhead(engine: LLMEngine, args: argparse.Namespace) -> None:
    rng = random.Random(args.dataset_seed)
    vocab = engine.config.model_config.vocab_size
    constraint = StructuredOutputsParams(json=_item_schema(args.min_items))
    base = dict(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    print(f"Time per output token (median decode step), {args.input_len} prompt + {args.output_len} output tokens:")
    for batch in args.batch_sizes:
        prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]} for _ in range(batch)]
        steps: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
        timings = engine.engine_core.step_timings
        splits = {}
        for _ in range(args.rounds):
            for label, params in (("unconstrained", SamplingParams(**base)),
                                  ("constrained", SamplingParams(**base, structured_outputs=constraint))):
                timings.reset()
                steps[label] += _decode_step_ms(engine, prompts, params)
                splits[label] = timings.report()
        free, constrained = statistics.median(steps["unconstrained"]), statistics.median(steps["constrained"])
        print(f"  batch {batch:>3}: {free:7.2f} ms unconstrained, {constrained:7.2f} ms with a JSON schema "
              f"({100 * (constrained / free - 1):+.1f}%)")
        # The grammar's work: masking in sample, advancing the matchers in update (the bitmask is in no phase: it is
        # computed on its own thread during the forward pass).
        for label, split in splits.items():
            print(f"    {label} (last round, all steps): {split}")


def measure_first_request(engine: LLMEngine, args: argparse.Namespace) -> None:
    prompt = {"prompt_token_ids": [random.Random(1).randrange(1000, 20000) for _ in range(args.input_len)]}
    base = dict(temperature=0.0, max_tokens=2, ignore_eos=True)
    _first_token_s(engine, prompt, SamplingParams(**base))  # warm-up
    free = _first_token_s(engine, prompt, SamplingParams(**base))
    cold = _first_token_s(engine, prompt, SamplingParams(**base, structured_outputs=StructuredOutputsParams(
        json=SCHEMAS["nested object"])))
    new = _first_token_s(engine, prompt, SamplingParams(**base, structured_outputs=StructuredOutputsParams(
        json=SCHEMAS["required fields"])))
    cached = _first_token_s(engine, prompt, SamplingParams(**base, structured_outputs=StructuredOutputsParams(
        json=SCHEMAS["required fields"])))
    print(f"First-request latency (time to first token, {args.input_len}-token prompt): unconstrained "
          f"{1000 * free:.0f} ms; JSON schema on a fresh engine (tokenizer view + compile) {1000 * cold:.0f} ms; "
          f"a new schema {1000 * new:.0f} ms; the same schema again (cached) {1000 * cached:.0f} ms")


def measure_validity(engine: LLMEngine, args: argparse.Namespace) -> tuple[int, int]:
    import jsonschema

    tokenizer = engine.tokenizer
    requests = {}
    for name, schema in SCHEMAS.items():
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[name]}], tokenize=False,
                                               add_generation_prompt=True)
        for i in range(args.num_per_schema):
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=256,
                                    structured_outputs=StructuredOutputsParams(json=schema))
            request_id = f"valid-{name}-{i}"
            requests[request_id] = name
            engine.add_request(request_id, {"prompt": prompt, "prompt_token_ids": tokenizer.encode(prompt)}, params)
    valid, failures = 0, {}
    while engine.has_unfinished_requests():
        for output in engine.step()[0]:
            name, text = requests[output.request_id], output.outputs[0].text
            try:
                jsonschema.validate(json.loads(text), SCHEMAS[name])
                valid += 1
            except (ValueError, jsonschema.ValidationError) as exc:
                failures[output.request_id] = f"{output.outputs[0].finish_reason}: {exc}"
    total = len(requests)
    print(f"Validity: {valid}/{total} objects over {len(SCHEMAS)} schemas ({', '.join(SCHEMAS)}) parse and "
          f"validate with jsonschema")
    for request_id, why in failures.items():
        print(f"  {request_id}: {why:.200}")
    return valid, total


def run(args: argparse.Namespace) -> dict[float, float] | None:
    """The tools workload returns its fraction of valid responses per temperature."""
    print(machine_header())
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    if args.workload == "tools":
        return structured_tools.measure_tool_calls(engine, args)
    measure_first_request(engine, args)
    measure_overhead(engine, args)
    measure_validity(engine, args)
    return None
