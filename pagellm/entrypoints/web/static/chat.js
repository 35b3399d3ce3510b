// The web chat at /: conversations (kept in localStorage by store.js), streaming answers (completion.js) rendered
// as safe Markdown (markdown.js), message editing, regeneration, stop, system prompt, settings and model picker.

import { apiFetch, ensureApiKey, errorMessage, el, serverConfig } from "./api.js";
import { formatStats, requestBody, streamChat } from "./completion.js";
import { renderMarkdown } from "./markdown.js";
import { ChatStore } from "./store.js";

const store = new ChatStore();
const $ = (id) => document.getElementById(id);
const SETTING_FIELDS = { temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens", seed: "seed" };
let controller = null; // the AbortController of the answer streaming now

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conversation of store.conversations) {
    const item = el("li", conversation.id === store.currentId ? "active" : "");
    const title = el("button", "title", conversation.title);
    title.onclick = () => { if (!controller) { store.select(conversation.id); renderAll(); } };
    const rename = el("button", "icon rename", "✎");
    rename.title = "Rename";
    rename.onclick = () => {
      const name = window.prompt("Rename the conversation", conversation.title);
      if (name !== null) { store.rename(conversation.id, name); renderSidebar(); }
    };
    const remove = el("button", "icon delete", "✕");
    remove.title = "Delete";
    remove.onclick = () => {
      if (controller && conversation.id === store.currentId) return;
      if (window.confirm(`Delete "${conversation.title}"?`)) { store.remove(conversation.id); renderAll(); }
    };
    item.append(title, rename, remove);
    list.append(item);
  }
}

function renderMessages() {
  const container = $("messages");
  container.replaceChildren();
  const conversation = store.current;
  if (!conversation) return;
  $("system-prompt").value = conversation.system;
  conversation.messages.forEach((message, index) => container.append(messageView(conversation, message, index)));
  container.scrollTop = container.scrollHeight;
}

function messageView(conversation, message, index) {
  const view = el("div", `message ${message.role}`);
  view.dataset.index = index;
  const content = el("div", "content");
  showContent(content, message);
  const actions = el("div", "actions");
  const edit = el("button", "edit", "Edit");
  edit.onclick = () => startEdit(view, conversation, index);
  actions.append(edit);
  if (message.role === "assistant") {
    const raw = el("button", "raw-toggle", "Raw");
    raw.onclick = () => {
      view.classList.toggle("show-raw");
      showContent(content, message, view.classList.contains("show-raw"));
    };
    actions.append(raw);
    if (index === conversation.messages.length - 1) {
      const again = el("button", "regenerate", "Regenerate");
      again.onclick = () => { if (!controller) { conversation.messages.pop(); generate(conversation); } };
      actions.append(again);
    }
  }
  view.append(el("div", "role", message.role === "user" ? "You" : "Assistant"), content);
  if (message.error) view.append(el("div", "error", message.error));
  if (message.stats) view.append(el("div", "stats", formatStats(message.stats)));
  view.append(actions);
  return view;
}

/** The user's text is shown as text; an answer as rendered Markdown, or as its raw text on request. */
function showContent(content, message, raw = false) {
  if (message.role === "user" || raw) content.replaceChildren(el("pre", "raw", message.content));
  else content.replaceChildren(renderMarkdown(message.content));
}

function startEdit(view, conversation, index) {
  if (controller) return;
  const message = conversation.messages[index];
  const editor = el("textarea", "editor");
  editor.value = message.content;
  const save = el("button", "save", message.role === "user" ? "Save & regenerate" : "Save");
  const cancel = el("button", "cancel", "Cancel");
  cancel.onclick = renderMessages;
  save.onclick = () => {
    message.content = editor.value;
    delete message.stats;
    delete message.error;
    if (message.role === "user") {
      conversation.messages.length = index + 1; // the answers after it no longer follow from it
      generate(conversation);
    } else {
      store.touch();
      renderMessages();
    }
  };
  view.querySelector(".content").replaceChildren(editor);
  view.querySelector(".actions").replaceChildren(save, cancel);
  editor.focus();
}

function readSettings() {
  for (const [field, id] of Object.entries(SETTING_FIELDS)) store.settings[field] = $(id).value;
  store.settings.model = $("model").value;
  store.save();
}

async function generate(conversation) {
  readSettings();
  const messages = conversation.messages.map(({ role, content }) => ({ role, content }));
  if (conversation.system.trim()) messages.unshift({ role: "system", content: conversation.system });
  const answer = { role: "assistant", content: "" };
  conversation.messages.push(answer);
  store.touch();
  renderAll();
  const view = $("messages").lastElementChild;
  const content = view.querySelector(".content");
  view.classList.add("streaming");
  controller = new AbortController();
  setBusy(true);
  let pending = false;
  try {
    const body = requestBody(store.settings.model, messages, store.settings);
    const result = await streamChat(body, controller.signal, (text) => {
      answer.content = text;
      if (!pending) { // re-render at most once a frame
        pending = true;
        requestAnimationFrame(() => { pending = false; showContent(content, answer); });
      }
    });
    answer.content = result.text;
    answer.stats = result.stats;
  } catch (error) {
    answer.error = error.name === "AbortError" ? "Stopped before the answer started." : String(error.message);
  } finally {
    controller = null;
    setBusy(false);
    store.touch();
    renderAll();
  }
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  document.body.classList.toggle("busy", busy);
}

function send() {
  const text = $("prompt").value;
  if (!text.trim() || controller) return;
  const conversation = store.ensureCurrent();
  if (!conversation.messages.length) conversation.title = text.trim().slice(0, 40);
  conversation.messages.push({ role: "user", content: text });
  $("prompt").value = "";
  generate(conversation);
}

function renderAll() {
  renderSidebar();
  renderMessages();
}

async function loadModels() {
  const response = await apiFetch("/v1/models");
  if (!response.ok) throw new Error(await errorMessage(response));
  const models = (await response.json()).data;
  const select = $("model");
  select.replaceChildren(...models.map((m) => {
    const option = el("option", "", m.id);
    option.value = m.id;
    return option;
  }));
  if (models.some((m) => m.id === store.settings.model)) select.value = store.settings.model;
  return models;
}

/** Each setting left blank uses the server's default, which the field and the note say. */
function showDefaults(defaults, maxModelLen) {
  const described = {
    temperature: String(defaults.temperature), top_p: String(defaults.top_p),
    max_tokens: defaults.max_tokens ?? `rest of the context (${maxModelLen} tokens in all)`,
    seed: defaults.seed ?? "none (random)",
  };
  for (const [field, id] of Object.entries(SETTING_FIELDS)) {
    $(id).placeholder = `server default: ${described[field]}`;
    $(id).value = store.settings[field] ?? "";
  }
  $("defaults-note").textContent = "Blank settings use the server's defaults: " +
    Object.entries(described).map(([field, value]) => `${field} ${value}`).join(", ") + ".";
}

async function init() {
  $("send").onclick = send;
  $("stop").onclick = () => controller?.abort();
  $("prompt").onkeydown = (event) => {
    if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); send(); }
  };
  $("new-chat").onclick = () => { if (!controller) { store.create(); renderAll(); } };
  $("settings-toggle").onclick = () => { $("settings").hidden = !$("settings").hidden; };
  $("system-prompt").onchange = () => { store.ensureCurrent().system = $("system-prompt").value; store.touch(); };
  for (const id of [...Object.values(SETTING_FIELDS), "model"]) $(id).onchange = readSettings;
  renderAll();
  try {
    await ensureApiKey();
    const [config, models] = await Promise.all([serverConfig(), loadModels()]);
    showDefaults(config.sampling_defaults, models[0]?.max_model_len);
    document.body.dataset.ready = "true";
  } catch (error) {
    $("status").textContent = `Could not reach the server: ${error.message}`;
  }
}

init();
