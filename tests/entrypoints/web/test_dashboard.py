"""The dashboard at /dashboard in headless Chromium while a load runs: every used-block count it shows is one that
/metrics reported within one update of it; requests appear in the running table and the grid colours their blocks;
after the run the grid holds only free and cached blocks. Writes docs/dashboard.png."""
from __future__ import annotations

import threading
import time

from playwright.sync_api import expect

UPDATE_S = 0.5  # the dashboard's interval (GET /web/config: state_interval_s.default)
USED_BLOCKS = ("pagellm:kv_cache_used_blocks", ())

# Records every value the page writes into #used-blocks, with the browser's clock (the same machine's clock).
RECORD_UPDATES = """() => {
    window.__updates = [];
    new MutationObserver(() => window.__updates.push([Date.now() / 1000,
                                                      Number(document.getElementById('used-blocks').textContent)]))
        .observe(document.getElementById('used-blocks'), {childList: true, characterData: true, subtree: true});
}"""


def poll_metrics(server, samples: list[tuple[float, float, float]], stop: threading.Event) -> None:
    """(sent, answered, value): the server read the value somewhere between the two (a busy server answers late)."""
    while not stop.is_set():
        sent = time.time()
        value = server.metrics()[USED_BLOCKS]
        samples.append((sent, time.time(), value))
        time.sleep(0.03)


def test_dashboard_follows_a_load(keyed_context, web_server, run_load, docs_dir):
    page = keyed_context.new_page()
    page.set_viewport_size({"width": 1280, "height": 1000})
    page.goto(web_server.url + "/dashboard")
    expect(page.locator("body")).to_have_attribute("data-live", "true")
    page.evaluate(RECORD_UPDATES)
    samples: list[tuple[float, float, float]] = []
    stop = threading.Event()
    poller = threading.Thread(target=poll_metrics, args=(web_server, samples, stop))
    poller.start()
    try:
        load = run_load(num_requests=6, max_tokens=32)
        expect(page.locator("#running-table tr")).to_have_count(8, timeout=60_000)  # header + 6 requests, n = 2
        expect(page.locator("#device-grid .cell.shared").first).to_be_visible()
        assert page.locator("#device-grid .cell.used").count() > 0
        page.screenshot(path=str(docs_dir / "dashboard.png"), full_page=True)
        load.wait()
        expect(page.locator("#running-count")).to_have_text("0", timeout=10_000)
        time.sleep(2 * UPDATE_S)
    finally:
        stop.set()
        poller.join()

    updates = page.evaluate("window.__updates")
    assert sum(value > 0 for _, value in updates) >= 3, updates  # the load was seen, over several updates
    for shown_at, value in updates:
        # /metrics between one update before the page showed the value and just after: the value shown must be one
        # of those readings, or lie between two of them (the poller may miss a value that lasted one short step).
        # The second of slack covers the page's own fetch on a loaded 2-core host (0.25 s once failed there, the
        # engine, server, browser and load generator sharing the cores).
        readings = [v for sent, answered, v in samples
                    if answered >= shown_at - UPDATE_S - 1.0 and sent <= shown_at + 0.1]
        assert readings and min(readings) <= value <= max(readings), (shown_at, value, readings)

    assert page.locator("#device-grid .cell.used, #device-grid .cell.shared").count() == 0
    assert page.locator("#device-grid .cell.cached").count() > 0  # the prompts' blocks stay in the prefix cache
    expect(page.locator("#used-blocks")).to_have_text("0")
    assert page.locator("#running-table tr").count() == 1
