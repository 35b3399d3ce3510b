// Talking to the server from both pages: the API key (asked once, kept in localStorage), fetch with the bearer
// token, and server-sent events read from a fetch() response (EventSource cannot send an Authorization header).

const KEY_STORAGE = "pagellm.apiKey";
let configPromise = null;

/** GET /web/config once: {api_key_required, sampling_defaults, state_interval_s}. */
export function serverConfig() {
  configPromise ??= fetch("/web/config").then((r) => {
    if (!r.ok) throw new Error(`GET /web/config answered ${r.status}`);
    return r.json();
  });
  return configPromise;
}

/** Resolves once a key is stored when the server wants one (asking for it in a dialog), at once otherwise. */
export async function ensureApiKey() {
  const config = await serverConfig();
  if (config.api_key_required && !localStorage.getItem(KEY_STORAGE)) await askForKey("");
}

function askForKey(message) {
  const dialog = document.getElementById("key-dialog");
  const input = dialog.querySelector("input");
  dialog.querySelector(".key-message").textContent = message;
  input.value = "";
  return new Promise((resolve) => {
    dialog.querySelector("form").onsubmit = (event) => {
      event.preventDefault();
      if (!input.value) return;
      localStorage.setItem(KEY_STORAGE, input.value);
      dialog.close();
      resolve();
    };
    dialog.showModal();
    input.focus();
  });
}

/** fetch() with the stored key as a bearer token. A 401 asks for the key again and retries once. */
export async function apiFetch(path, options = {}) {
  await ensureApiKey();
  const send = () => {
    const headers = { ...(options.headers || {}) };
    const key = localStorage.getItem(KEY_STORAGE);
    if (key) headers.Authorization = `Bearer ${key}`;
    return fetch(path, { ...options, headers });
  };
  let response = await send();
  if (response.status === 401 && (await serverConfig()).api_key_required) {
    localStorage.removeItem(KEY_STORAGE);
    await askForKey("The server refused that key; enter it again.");
    response = await send();
  }
  return response;
}

/** The message of an OpenAI error body, or the status line. */
export async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch (_) { /* not JSON */ }
  return `${response.status} ${response.statusText}`;
}

/** Calls onData(parsed JSON) for each `data:` event of an SSE response until it ends ("[DONE]" ends it too). */
export async function readEvents(response, onData) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data === "[DONE]") return;
      if (data) onData(JSON.parse(data));
    }
  }
}

/** A new element with a class and text (always as text, never as HTML). */
export function el(tag, className = "", text = "") {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text) node.textContent = text;
  return node;
}
