// The chat's state in the browser's localStorage: the conversations (each with its system prompt and messages,
// answers with their statistics), which one is open, and the sampling settings. Nothing of it is on the server.

const CONVERSATIONS = "pagellm.conversations";
const CURRENT = "pagellm.currentConversation";
const SETTINGS = "pagellm.settings";

function read(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key));
    return value ?? fallback;
  } catch (_) {
    return fallback; // unreadable (edited by hand): start afresh rather than break the page
  }
}

export class ChatStore {
  constructor() {
    this.conversations = read(CONVERSATIONS, []);
    this.currentId = localStorage.getItem(CURRENT);
    if (!this.conversations.some((c) => c.id === this.currentId)) this.currentId = null;
    this.settings = read(SETTINGS, {});
  }

  get current() {
    return this.conversations.find((c) => c.id === this.currentId) ?? null;
  }

  /** The open conversation, created on first use. */
  ensureCurrent() {
    return this.current ?? this.create();
  }

  create() {
    const conversation = { id: crypto.randomUUID(), title: "New chat", system: "", messages: [], updated: Date.now() };
    this.conversations.unshift(conversation);
    this.select(conversation.id);
    return conversation;
  }

  select(id) {
    this.currentId = id;
    localStorage.setItem(CURRENT, id);
    this.save();
  }

  rename(id, title) {
    const conversation = this.conversations.find((c) => c.id === id);
    if (conversation && title.trim()) conversation.title = title.trim();
    this.save();
  }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    if (this.currentId === id) {
      this.currentId = this.conversations[0]?.id ?? null;
      if (this.currentId) localStorage.setItem(CURRENT, this.currentId);
      else localStorage.removeItem(CURRENT);
    }
    this.save();
  }

  /** Persist everything; the open conversation moves to the top of the list when it changed. */
  touch() {
    const conversation = this.current;
    if (conversation) conversation.updated = Date.now();
    this.conversations.sort((a, b) => b.updated - a.updated);
    this.save();
  }

  save() {
    localStorage.setItem(CONVERSATIONS, JSON.stringify(this.conversations));
    localStorage.setItem(SETTINGS, JSON.stringify(this.settings));
  }
}
