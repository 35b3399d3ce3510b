"""`pagellm bench soak`: mixed, partly hostile traffic against a running OpenAI-compatible server, then a check
that it recovered.

For --duration seconds, --concurrency clients send completions and chat completions (streaming or not, random
prompt and output lengths that fit max_model_len, sometimes n > 1, greedy, seeded or unseeded sampling) and now
and then /tokenize. A --disconnect-fraction of them is abandoned by the client (before the response headers, or
after some streamed chunks) and a --bad-fraction is deliberately invalid (BAD_REQUESTS: each must get its 4xx).
Then the server must drain: /metrics shows no running or waiting request and no KV block in use. The exit status
is 1 when the server misbehaved (a 5xx, an unexpected outcome, a leaked block, /health not 200).

Request i's plan depends only on --seed and i (`plan_request`), so a run is reproducible apart from timing.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from pagellm.benchmarks.serve_load import add_server_args, listed_model, server_address
from pagellm.benchmarks.serve_prompts import load_tokenizer, random_prompts
from pagellm.benchmarks.soak_report import (
    Outcome,
    ServerState,
    SoakReport,
    drain,
    fetch_state,
    health_status,
    summarize,
)

PROMPT_POOL_SIZE = 32
LENGTH_SLACK_TOKENS = 8  # re-tokenizing a decoded prompt on the server can merge or split a few tokens
TOKENIZE_FRACTION = 0.05
N_CHOICES = (1, 1, 1, 1, 2, 3)  # mostly single sequences, sometimes forks sharing the prompt's blocks
MAX_ABANDON_CHUNKS = 8
ABANDON_DELAY_RANGE_S = (0.02, 0.3)  # long enough for the request to reach the server

BadRequestMaker = Callable[[str, int], tuple[str, dict | bytes]]  # (model, max_model_len) -> (path, body)


def _completion(model: str, **fields: object) -> tuple[str, dict]:
    return "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 4, **fields}


# Requests the server must refuse, with the status it must refuse them with. Dict bodies also get the plan's
# "stream" flag: a refusal must come before a stream starts.
BAD_REQUESTS: dict[str, tuple[BadRequestMaker, int]] = {
    "temperature -1": (lambda model, _: _completion(model, temperature=-1), 400),
    "n 0": (lambda model, _: _completion(model, n=0), 400),
    "top_p 2": (lambda model, _: _completion(model, top_p=2), 400),
    "unknown model": (lambda model, _: _completion(f"{model}-no-such-model"), 404),
    "malformed JSON": (lambda model, _: ("/v1/completions", b'{"model": "' + model.encode() + b'", "prompt": '),
                       400),
    "prompt over max_model_len": (lambda model, max_len: _completion(model, prompt="hello " * (4 * max_len)), 400),
    "empty messages": (lambda model, _: ("/v1/chat/completions", {"model": model, "messages": []}), 400),
    "unknown role": (lambda model, _: ("/v1/chat/completions", {"model": model, "messages": [
        {"role": "wizard", "content": "hi"}]}), 400),
    # Values that once stopped the engine for everyone, and options that must never be silently ignored.
    "seed over 64 bits": (lambda model, _: _completion(model, seed=2**64), 400),
    "top_k 2**63": (lambda model, _: _completion(model, top_k=2**63), 400),
    "stop token outside the vocabulary": (lambda model, _: _completion(model, stop_token_ids=[10**9], min_tokens=1),
                                          400),
    "n beyond capacity": (lambda model, _: _completion(model, n=10**6), 400),
    "NaN temperature": (lambda model, _: ("/v1/completions", b'{"model": "' + model.encode()
                                          + b'", "prompt": "Hello", "temperature": NaN}'), 400),
    "guided_json": (lambda model, _: _completion(model, guided_json={"type": "object"}), 400),
}


@dataclass(frozen=True, slots=True)
class TrafficMix:
    bad_fraction: float
    disconnect_fraction: float
    max_output_len: int


@dataclass(slots=True)
class PlannedRequest:
    kind: str  # "completion", "chat", "tokenize", or a key of BAD_REQUESTS
    stream: bool = False
    prompt_index: int = 0  # into the prompt pool
    max_tokens: int = 1
    n: int = 1
    sampling: dict = field(default_factory=dict)
    abandon_after_chunks: int | None = None  # None: read to the end; 0: before the response headers
    abandon_delay_s: float = 0.0  # when abandoning before the headers: how long after sending


@dataclass(slots=True)
class Target:
    base_url: str
    headers: dict[str, str]
    model: str
    max_model_len: int
    chat_overhead: int  # tokens the chat template adds around one user message
    prompts: list[str] = field(default_factory=list)


def plan_request(seed: int, index: int, prompt_lens: Sequence[int], token_budget: int,
                 mix: TrafficMix) -> PlannedRequest:
    """Request `index` of a run: what it is, how long, whether and when the client abandons it."""
    rng = random.Random(f"{seed}:{index}")  # a string seed hashes the same in every process
    draw, stream = rng.random(), rng.random() < 0.5
    if draw < mix.bad_fraction:
        return PlannedRequest(kind=rng.choice(list(BAD_REQUESTS)), stream=stream)
    abandon = draw < mix.bad_fraction + mix.disconnect_fraction
    prompt_index = rng.randrange(len(prompt_lens))
    if not abandon and rng.random() < TOKENIZE_FRACTION:
        return PlannedRequest(kind="tokenize", prompt_index=prompt_index)
    room = max(1, min(mix.max_output_len, token_budget - prompt_lens[prompt_index]))
    sampling = rng.choice(({"temperature": 0.0}, {"temperature": 0.8, "seed": rng.randrange(2**31)},
                           {"temperature": 1.0, "top_p": 0.9}))
    plan = PlannedRequest(kind=rng.choice(("completion", "chat")), stream=stream, prompt_index=prompt_index,
                          max_tokens=rng.randint(1, room), n=rng.choice(N_CHOICES), sampling=sampling)
    if abandon:  # a response that is not streamed has no chunks: it is abandoned before its headers
        plan.abandon_after_chunks = rng.randint(0, MAX_ABANDON_CHUNKS) if stream else 0
        plan.abandon_delay_s = rng.uniform(*ABANDON_DELAY_RANGE_S)
    return plan


def build_request(plan: PlannedRequest, target: Target) -> tuple[str, dict | bytes, int]:
    """(path, JSON body or raw bytes, expected status) of a planned request."""
    if plan.kind in BAD_REQUESTS:
        make, status = BAD_REQUESTS[plan.kind]
        path, body = make(target.model, target.max_model_len)
        return path, ({**body, "stream": plan.stream} if isinstance(body, dict) else body), status
    prompt = target.prompts[plan.prompt_index]
    if plan.kind == "tokenize":
        return "/tokenize", {"model": target.model, "prompt": prompt}, 200
    body = {"model": target.model, "n": plan.n, "stream": plan.stream, **plan.sampling}
    if plan.stream:
        body["stream_options"] = {"include_usage": True}
    if plan.kind == "chat":
        body.update(messages=[{"role": "user", "content": prompt}], max_completion_tokens=plan.max_tokens)
        return "/v1/chat/completions", body, 200
    return "/v1/completions", {**body, "prompt": prompt, "max_tokens": plan.max_tokens}, 200


def _finished_choices(payload: dict) -> set[int]:
    return {c.get("index") for c in payload.get("choices") or () if c.get("finish_reason")}


def _is_whole_answer(plan: PlannedRequest, payload: dict) -> bool:
    """A 200 body holds the prompt's tokens, or every choice the request asked for, finished."""
    if plan.kind == "tokenize":
        return payload.get("count", 0) > 0 and len(payload.get("tokens") or ()) == payload["count"]
    return len(_finished_choices(payload)) == plan.n


async def _exchange(client: httpx.AsyncClient, url: str, headers: dict[str, str], content: bytes,
                    plan: PlannedRequest, outcome: Outcome) -> None:
    async with client.stream("POST", url, content=content, headers=headers) as response:
        outcome.status = response.status_code
        if response.status_code != 200 or not plan.stream:
            outcome.body = (await response.aread()).decode(errors="replace")
            outcome.served = response.status_code == 200 and _is_whole_answer(plan, json.loads(outcome.body))
            return
        finished, events = set(), 0
        async for line in response.aiter_lines():
            data = line[5:].strip() if line.startswith("data:") else None  # skip separators and comments
            if data == "[DONE]":
                outcome.served = len(finished) == plan.n
                return
            if data:
                outcome.body = data
                chunk = json.loads(data)
                if "error" in chunk:  # the stream broke after its 200 headers
                    return
                finished |= _finished_choices(chunk)
                events += 1
                if events == plan.abandon_after_chunks:  # leaving the block closes the half-read connection
                    outcome.abandoned = True
                    return


async def send(client: httpx.AsyncClient, target: Target, plan: PlannedRequest) -> Outcome:
    path, body, expected_status = build_request(plan, target)
    outcome = Outcome(kind=plan.kind, expected_status=expected_status)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**target.headers, "Content-Type": "application/json"}
    exchange = _exchange(client, target.base_url + path, headers, content, plan, outcome)
    try:
        if plan.abandon_after_chunks == 0:
            await asyncio.wait_for(exchange, plan.abandon_delay_s)  # cancelling the send closes its connection
        else:
            await exchange
    except TimeoutError:
        outcome.abandoned = True
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: a body that is not the JSON it should be
        outcome.error = f"{type(exc).__name__}: {exc}"
    return outcome


async def run_soak(target: Target, plans: Callable[[int], PlannedRequest], concurrency: int, duration_s: float,
                   drain_timeout_s: float, request_timeout_s: float) -> SoakReport:
    """Traffic from `concurrency` clients for `duration_s` (requests in flight at the end are finished), the
    server's state read halfway, then the drain and the final /health."""
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=10.0), limits=limits) as client:
        start_state = await fetch_state(client, target.base_url)
        outcomes: list[Outcome] = []
        indices = itertools.count()
        start = time.monotonic()

        async def one_client() -> None:
            while time.monotonic() - start < duration_s:
                outcomes.append(await send(client, target, plans(next(indices))))

        async def halfway() -> ServerState:
            await asyncio.sleep(duration_s / 2)
            return await fetch_state(client, target.base_url)

        halfway_state, *_ = await asyncio.gather(halfway(), *(one_client() for _ in range(concurrency)))
        duration = time.monotonic() - start
        end_state = await drain(client, target.base_url, drain_timeout_s)
        health = await health_status(client, target.base_url)
    return summarize(outcomes, duration, start_state, end_state, health, halfway=halfway_state)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_server_args(parser)
    parser.add_argument("--tokenizer", default=None, help="builds the random prompts (default: the default model's)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of traffic, before the drain")
    parser.add_argument("--concurrency", type=int, default=8, help="clients sending one request at a time each")
    parser.add_argument("--disconnect-fraction", type=float, default=0.1, help="requests the client abandons")
    parser.add_argument("--bad-fraction", type=float, default=0.05, help="invalid requests that must get a 4xx")
    parser.add_argument("--max-output-len", type=int, default=256, help="upper bound of a request's max_tokens")
    parser.add_argument("--drain-timeout", type=float, default=60.0, help="seconds to wait for an idle server")
    parser.add_argument("--request-timeout", type=float, default=120.0,
                        help="seconds a request may take before it counts as a failure (raise it for a slow "
                             "server under heavy load)")
    parser.add_argument("--seed", type=int, default=0, help="chooses request kinds, lengths and disconnects")
    parser.add_argument("--json", "--output-json", dest="json_path", default=None, metavar="PATH",
                        help="also write the report as JSON")


def _validate(args: argparse.Namespace) -> None:
    checks = [(args.duration > 0 and args.drain_timeout > 0 and args.request_timeout > 0,
               "--duration, --drain-timeout and --request-timeout must be > 0"),
              (args.concurrency >= 1, "--concurrency must be >= 1"),
              (args.max_output_len >= 1, "--max-output-len must be >= 1"),
              (0 <= args.bad_fraction and 0 <= args.disconnect_fraction
               and args.bad_fraction + args.disconnect_fraction <= 1,
               "--bad-fraction and --disconnect-fraction must be >= 0 with a sum <= 1")]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def _connect(args: argparse.Namespace) -> Target:
    """The server, its model and that model's lengths, without prompts yet."""
    base_url, headers = server_address(args)
    model = args.model or listed_model(base_url, headers)  # raises ConnectionError when unreachable
    cards = {card["id"]: card for card in _json_or_raise(httpx.get(f"{base_url}/v1/models", headers=headers,
                                                                   timeout=10.0))["data"]}
    if model not in cards:
        raise ValueError(f"{base_url}/v1/models does not list model {model!r} (it lists {', '.join(cards)})")
    empty_chat = _json_or_raise(httpx.post(f"{base_url}/tokenize", headers=headers, timeout=10.0, json={
        "model": model, "messages": [{"role": "user", "content": ""}]}))
    return Target(base_url, headers, model, int(cards[model]["max_model_len"]), empty_chat["count"])


def _json_or_raise(response: httpx.Response) -> dict:
    if response.status_code != 200:  # e.g. a missing --api-key: say so rather than soak with 401s
        raise ValueError(f"{response.request.method} {response.request.url} answered {response.status_code}: "
                         f"{response.text[:200]}")
    return response.json()


def run(args: argparse.Namespace) -> int:
    """Soak the server, print the report (and write --json); 0 if the server behaved, else 1."""
    _validate(args)
    target = _connect(args)
    token_budget = target.max_model_len - target.chat_overhead - LENGTH_SLACK_TOKENS  # prompt + max_tokens
    if token_budget < 2:
        raise ValueError(f"max_model_len {target.max_model_len} leaves no room for a prompt and an output")
    # Prompt lengths uniform in [1, budget - 1]: random_prompts draws them around a mean, within +-99 percent.
    pool = random_prompts(load_tokenizer(args.tokenizer), PROMPT_POOL_SIZE, max(1, (token_budget - 1) // 2), 1,
                          0.99, args.seed)
    target.prompts = [p.prompt for p in pool]
    prompt_lens = [p.prompt_len for p in pool]
    mix = TrafficMix(args.bad_fraction, args.disconnect_fraction, args.max_output_len)
    print(f"soaking {target.base_url} (model {target.model}, max_model_len {target.max_model_len}) for "
          f"{args.duration:g} s with {args.concurrency} clients, seed {args.seed}")
    report = asyncio.run(run_soak(target, lambda i: plan_request(args.seed, i, prompt_lens, token_budget, mix),
                                  args.concurrency, args.duration, args.drain_timeout, args.request_timeout))
    print(report.format())
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({**asdict(report), "problems": report.problems()}, indent=2))
    return report.exit_status
