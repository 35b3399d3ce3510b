"""The web chat at / in headless Chromium, against a live server of the default model: the key is asked once; a
question typed into the page streams an answer equal to the API's greedy answer, with its statistics (and cached
prompt tokens on the next turn); Stop frees the request on the server; model text and user text containing markup
render as text; conversations can be created, renamed and deleted. Writes docs/web-chat.png."""
from __future__ import annotations

import json
import re

from playwright.sync_api import BrowserContext, Page, expect

QUESTION = "What is a paged KV cache? Answer in two sentences."
MAX_TOKENS = 40
XSS = ['<script>window.__xss = "script"</script>', '<img src=x onerror="window.__xss = \'img\'">']


def open_chat(context: BrowserContext, url: str) -> Page:
    page = context.new_page()
    page.goto(url + "/")
    return page


def ready(page: Page) -> None:
    expect(page.locator("body")).to_have_attribute("data-ready", "true")


def ask(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last_answer(page: Page):
    return page.locator(".message.assistant").last


def test_chat_round_trip_equals_the_api_greedy_answer(context, web_server, api, docs_dir):
    page = open_chat(context, web_server.url)
    dialog = page.locator("#key-dialog")
    expect(dialog).to_be_visible()  # the server wants a key: asked before anything else
    dialog.locator("input").fill(web_server.api_key)
    dialog.locator("button").click()
    ready(page)
    served = [m["id"] for m in api.get("/v1/models").json()["data"]]
    assert page.locator("#model option").all_inner_texts() == served
    page.click("#settings-toggle")
    expect(page.locator("#temperature")).to_have_attribute("placeholder", "server default: 1")
    expect(page.locator("#defaults-note")).to_contain_text("max_tokens rest of the context (2048 tokens in all)")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(MAX_TOKENS))
    ask(page, QUESTION)

    answer = last_answer(page)
    stats = answer.locator(".stats")
    expect(stats).to_contain_text("finish:", timeout=60_000)
    expected = api.post("/v1/chat/completions", json={
        "model": served[0], "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
        "max_tokens": MAX_TOKENS}).json()
    answer.locator(".raw-toggle").click()
    assert answer.locator("pre.raw").text_content() == expected["choices"][0]["message"]["content"]
    usage, finish = expected["usage"], expected["choices"][0]["finish_reason"]
    assert stats.text_content().startswith(
        f"prompt {usage['prompt_tokens']} tok (0 cached) · output {usage['completion_tokens']} tok · TTFT ")
    assert stats.text_content().endswith(f"tok/s · finish: {finish}")

    ask(page, "Give one example.")  # the second turn resends the first: its blocks come from the prefix cache
    expect(last_answer(page).locator(".stats")).to_contain_text("finish:", timeout=60_000)
    cached = int(last_answer(page).locator(".stats").text_content().split("(")[1].split(" cached")[0])
    assert cached >= 16
    page.screenshot(path=str(docs_dir / "web-chat.png"))

    page.reload()  # the key is asked once; the conversation is still there
    ready(page)
    expect(dialog).not_to_be_visible()
    expect(page.locator(".message")).to_have_count(4)


def test_stop_aborts_the_request_and_frees_its_blocks(keyed_context, web_server):
    before = web_server.metrics()
    page = open_chat(keyed_context, web_server.url)
    ready(page)
    ask(page, "Write a very long story about a dragon who learns to cook. Make it at least twenty paragraphs.")
    expect(page.locator("#stop")).to_be_visible()
    expect(last_answer(page).locator(".content")).to_have_text(re.compile(r"(\S+\s+){3}"), timeout=60_000)
    assert web_server.metrics()[("pagellm:num_requests_running", ())] == 1  # a few words are in, more to come
    page.click("#stop")
    expect(last_answer(page).locator(".stats")).to_contain_text("finish: stopped")
    expect(page.locator("#send")).to_be_visible()
    after = web_server.wait_until_idle(timeout_s=10)
    assert after[("pagellm:num_requests_running", ())] == 0
    assert after[("pagellm:kv_cache_used_blocks", ())] == 0
    aborted = ("pagellm:request_success_total", (("finished_reason", "abort"),))
    assert after[aborted] == before[aborted] + 1


def assert_no_markup_ran(page: Page) -> None:
    assert page.evaluate("window.__xss") is None
    assert page.locator("#messages img, #messages script, #messages [onerror]").count() == 0


def test_markup_in_answers_and_messages_renders_as_text(keyed_context, web_server):
    page = open_chat(keyed_context, web_server.url)
    ready(page)
    # The renderer itself, on everything Markdown can carry markup in.
    leaked = page.evaluate("""async (xss) => {
        const { renderMarkdown } = await import('/static/markdown.js');
        const box = document.createElement('div');
        const text = [xss[0], xss[1], '**' + xss[1] + '**', '`' + xss[0] + '`', '```html\\n' + xss[1] + '\\n```',
                      '# ' + xss[1], '> ' + xss[0], '- ' + xss[1], '[click](javascript:window.__xss="link")',
                      '[x](data:text/html,' + xss[0] + ')'].join('\\n\\n');
        box.append(renderMarkdown(text));
        document.body.append(box);
        return {elements: box.querySelectorAll('script, img, [onerror], a').length, text: box.textContent};
    }""", XSS)
    assert leaked["elements"] == 0 and all(x in leaked["text"] for x in XSS)
    assert "[click](javascript:" in leaked["text"]

    # A streamed answer that carries markup, through the page's own streaming path (the server is stood in for,
    # since no model can be made to say this on demand).
    reply = f"Here: {XSS[0]} and {XSS[1]}\n\n```\n{XSS[1]}\n```"
    body = "".join(f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': part}}]})}\n\n"
                   for part in (reply[:20], reply[20:]))
    body += 'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=body))
    ask(page, "Say something with markup.")
    expect(last_answer(page).locator(".stats")).to_contain_text("finish: stop")
    assert_no_markup_ran(page)
    for x in XSS:
        expect(last_answer(page).locator(".content")).to_contain_text(x)
    page.unroute("**/v1/chat/completions")

    # Editing the user's message to markup, then regenerating against the real server (a short greedy answer).
    page.click("#settings-toggle")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "16")
    page.locator(".message.user .edit").first.click()
    page.fill(".message.user .editor", XSS[1])
    page.locator(".message.user .save").click()
    expect(last_answer(page).locator(".stats")).to_contain_text("finish:", timeout=60_000)
    expect(page.locator(".message")).to_have_count(2)  # the answer after the edited message was replaced
    expect(page.locator(".message.user .content")).to_have_text(XSS[1])
    assert_no_markup_ran(page)


def test_conversations_new_rename_delete(keyed_context, web_server):
    page = open_chat(keyed_context, web_server.url)
    ready(page)
    page.click("#new-chat")
    page.click("#new-chat")
    expect(page.locator("#conversations li")).to_have_count(2)
    page.once("dialog", lambda dialog: dialog.accept("Renamed chat"))
    page.locator("#conversations li").first.locator(".rename").click()
    expect(page.locator("#conversations li").first.locator(".title")).to_have_text("Renamed chat")
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("#conversations li").first.locator(".delete").click()
    expect(page.locator("#conversations li")).to_have_count(1)
    stored = page.evaluate("JSON.parse(localStorage.getItem('pagellm.conversations')).map(c => c.title)")
    assert stored == ["New chat"]
