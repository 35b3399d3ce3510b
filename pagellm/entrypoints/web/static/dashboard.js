// The live dashboard at /dashboard: reads GET /v1/engine/state/stream (with the API key as a bearer token, through
// fetch) and draws the KV block grids (kvgrid.js), the queues, and the time series (charts.js).

import { apiFetch, el, errorMessage, readEvents, serverConfig } from "./api.js";
import { History, drawChart } from "./charts.js";
import { BlockGrid, blockOwners, requestHue } from "./kvgrid.js";

const $ = (id) => document.getElementById(id);
const RECONNECT_MS = 2000;
const history = new History();
const deviceGrid = new BlockGrid($("device-grid"), 8192);
const hostGrid = new BlockGrid($("host-grid"), 1024); // the host tier is often far larger: keep it to a few rows

function update(payload) {
  if (payload.error) {
    $("connection").textContent = `error: ${payload.error.message}`;
    return;
  }
  const engine = payload.engine;
  const requests = [...engine.running, ...engine.waiting];
  showSummary(engine);
  deviceGrid.update(engine.device, blockOwners(requests, "blocks"));
  $("host-section").hidden = engine.host === null;
  if (engine.host !== null) {
    const host = engine.host.counts;
    $("host-summary").textContent = `${host.used + host.shared} used, ${host.cached} cached, ${host.free} free ` +
      `of ${engine.host.num_blocks}`;
    hostGrid.update(engine.host, blockOwners(requests, "host_blocks"));
  }
  showQueue($("running-table"), engine.running, engine.num_running);
  showQueue($("waiting-table"), engine.waiting, engine.num_waiting);
  history.merge(payload.history);
  showCharts(payload.time);
  $("updated-at").textContent = new Date(payload.time * 1000).toLocaleTimeString();
}

function showSummary(engine) {
  const counts = engine.device.counts;
  const used = counts.used + counts.shared; // held blocks: what /metrics calls kv_cache_used_blocks
  $("used-blocks").textContent = used;
  $("shared-blocks").textContent = counts.shared;
  $("cached-blocks").textContent = counts.cached;
  $("free-blocks").textContent = counts.free;
  $("total-blocks").textContent = engine.device.num_blocks;
  $("block-size").textContent = engine.block_size;
  $("kv-usage").textContent = `${((100 * used) / engine.device.num_blocks).toFixed(1)}%`;
  $("running-count").textContent = engine.num_running;
  $("waiting-count").textContent = engine.num_waiting;
  $("preemptions").textContent = engine.num_preemptions_total;
  $("window-summary").hidden = engine.sliding_window === null;
  $("sliding-window").textContent = engine.sliding_window;
  $("window-freed").textContent = engine.window_freed_blocks_total;
  // Several KV cache groups (Gemma 3: full attention and sliding windows): each one's blocks and the freed ones.
  const groups = engine.kv_cache_groups || [];
  $("group-summary").hidden = groups.length < 2;
  $("kv-groups").textContent = groups.map((g, i) => `#${i} ${g.window === null ? "full" : `window ${g.window}`}: `
    + `${g.num_blocks} held` + (g.window === null ? "" : `, ${g.window_freed_blocks_total} freed`)).join(" · ");
}

const COLUMNS = ["request", "status", "prompt computed / total", "generated / max", "blocks", "cached tokens",
  "preemptions", "priority"];

function showQueue(table, requests, total) {
  const head = el("tr");
  head.append(...COLUMNS.map((name) => el("th", "", name)));
  const rows = requests.map((r) => {
    const row = el("tr");
    const name = el("td", "request");
    const swatch = el("i", "swatch");
    swatch.style.setProperty("--hue", requestHue(r.group_id));
    name.append(swatch, document.createTextNode(r.request_id));
    const computed = Math.min(r.num_computed_tokens, r.num_prompt_tokens);
    const progress = el("td", "progress");
    const bar = el("span", "bar");
    bar.style.width = `${(100 * computed) / r.num_prompt_tokens}%`;
    progress.append(bar, el("span", "", `${computed} / ${r.num_prompt_tokens}`));
    let blocks = r.host_blocks.length ? `${r.blocks.length} (+${r.host_blocks.length} on host)` : `${r.blocks.length}`;
    if (r.num_window_freed_blocks) blocks += ` (${r.num_window_freed_blocks} freed by the window)`;
    row.append(name, el("td", "", r.status), progress, el("td", "", `${r.num_output_tokens} / ${r.max_tokens}`),
      el("td", "", String(blocks)), el("td", "", String(r.num_cached_tokens)),
      el("td", "", String(r.num_preemptions)), el("td", "", String(r.priority)));
    return row;
  });
  if (total > requests.length) {
    const more = el("tr");
    const cell = el("td", "more", `… and ${total - requests.length} more`);
    cell.colSpan = COLUMNS.length;
    more.append(cell);
    rows.push(more);
  }
  table.replaceChildren(head, ...rows);
}

function showCharts(now) {
  const times = history.column("time");
  const last = (name) => { const values = history.column(name); return values[values.length - 1] ?? 0; };
  const charts = [
    ["generation", [{ values: history.column("generation_tokens_per_s"), color: "#2a7" }],
      last("generation_tokens_per_s").toFixed(1)],
    ["prompt", [{ values: history.column("prompt_tokens_per_s"), color: "#27c" }], last("prompt_tokens_per_s").toFixed(1)],
    ["kv", [{ values: history.column("kv_cache_usage").map((v) => 100 * v), color: "#c72" }],
      `${(100 * last("kv_cache_usage")).toFixed(1)}%`, 100],
    ["preemptions", [{ values: history.column("num_preemptions"), color: "#c33" }], String(last("num_preemptions"))],
    ["requests", [{ values: history.column("num_running"), color: "#2a7" },
      { values: history.column("num_waiting"), color: "#c72" }], `${last("num_running")} / ${last("num_waiting")}`],
  ];
  for (const [name, lines, label, max] of charts) {
    drawChart($(`chart-${name}`), times, lines, now, max ?? null);
    document.querySelector(`[data-for="${name}"]`).textContent = label;
  }
}

async function follow() {
  const interval = (await serverConfig()).state_interval_s.default;
  for (;;) {
    try {
      const response = await apiFetch(`/v1/engine/state/stream?interval=${interval}`);
      if (!response.ok) throw new Error(await errorMessage(response));
      $("connection").textContent = "live";
      document.body.dataset.live = "true";
      await readEvents(response, update);
      $("connection").textContent = "the stream ended; reconnecting…";
    } catch (error) {
      $("connection").textContent = `disconnected (${error.message}); retrying…`;
    }
    document.body.dataset.live = "false";
    await new Promise((resolve) => setTimeout(resolve, RECONNECT_MS));
  }
}

follow();
