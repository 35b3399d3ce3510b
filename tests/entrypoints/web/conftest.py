"""The web pages' tests: one live `pagellm serve` of the default model (SmolLM2, so the answers and the screenshots
are real text) with an API key and a KV pool small enough that the dashboard's grid shows every block, and one
headless Chromium per module (Playwright's sync API holds a running event loop until it stops, which would break
asyncio.run in later test modules): Debian's `chromium` package driven by Playwright (`make test` installs both;
Playwright's own browser download needs internet access)."""
from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, BrowserContext, sync_playwright

API_KEY = "web-test-key"
CHROMIUM = os.environ.get("PAGELLM_TEST_CHROMIUM", "/usr/bin/chromium")
VIEWPORT = {"width": 1280, "height": 800}


@pytest.fixture(scope="session")
def web_server(smollm2_dir, start_server):
    # 96 MiB of SmolLM2's KV cache is 136 blocks of 16 tokens: a grid that fits a screenshot, and a context of
    # 2048 tokens (the last --max-model-len wins) so a stopped answer has room to be long.
    yield from start_server(smollm2_dir, "--api-key", API_KEY, "--kv-cache-memory", "96MiB",
                            "--max-model-len", "2048", "--max-num-seqs", "16")


@pytest.fixture(scope="session")
def api(web_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=web_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def docs_dir() -> Path:
    """Where the tests write the README's screenshots."""
    return Path(__file__).resolve().parents[3] / "docs"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium (apt-get install chromium), or "
                    f"point PAGELLM_TEST_CHROMIUM at a Chromium binary.")
    with sync_playwright() as playwright:
        # --no-sandbox: the tests may run as root (containers, CI), where Chromium's sandbox refuses to start.
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def context(browser) -> Iterator[BrowserContext]:
    """A fresh browser profile (empty localStorage) per test; page errors fail the test."""
    context = browser.new_context(viewport=VIEWPORT)
    errors: list[str] = []
    context.on("weberror", lambda error: errors.append(str(error.error)))
    yield context
    context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


@pytest.fixture
def keyed_context(context) -> BrowserContext:
    """A profile that already holds the API key (as the chat leaves it after asking once)."""
    # Not on the first about:blank document, whose localStorage is off limits.
    context.add_init_script(f"if (location.protocol === 'http:') localStorage.setItem('pagellm.apiKey', {API_KEY!r})")
    return context


SYSTEM_PROMPT = ("You are a patient teacher. You explain computer science to students with short, clear sentences "
                 "and one concrete example each time. ") * 3


def load_requests(num_requests: int, max_tokens: int) -> list[dict]:
    """Chats that share a long system prompt (prefix-cache hits: blocks shared across requests) and one with n = 2
    (its two sequences share the prompt's blocks)."""
    return [{"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                          {"role": "user", "content": f"Question {i}: what is a {topic}?"}],
             "max_tokens": max_tokens, "temperature": 0.8, "seed": i, "n": 2 if i == 0 else 1}
            for i, topic in enumerate(["hash table", "linked list", "binary tree", "page table", "mutex", "cache",
                                       "stack", "queue"][:num_requests])]


class Load:
    """Chats sent at once, each from its own thread."""

    def __init__(self, api: httpx.Client, bodies: list[dict]) -> None:
        executor = concurrent.futures.ThreadPoolExecutor(len(bodies))
        self.futures = [executor.submit(api.post, "/v1/chat/completions", json=body) for body in bodies]
        executor.shutdown(wait=False)

    def done(self) -> bool:
        return all(future.done() for future in self.futures)

    def wait(self) -> None:
        responses = [future.result() for future in self.futures]
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]


@pytest.fixture(scope="session")
def run_load(api) -> Callable[..., Load]:
    """run_load(num_requests, max_tokens) starts load_requests(...) at once."""
    return lambda num_requests=6, max_tokens=48: Load(api, load_requests(num_requests, max_tokens))
