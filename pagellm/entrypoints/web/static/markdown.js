// A small Markdown renderer that is safe for model output: it builds DOM nodes and puts every piece of the text in
// with createTextNode / textContent, so `<script>` or `<img onerror=...>` in a reply show up as text and never run.
// Links keep only http(s) and mailto targets. Covered: fenced code blocks (an unclosed fence while a reply streams
// is code so far), headings, block quotes, lists, rules, paragraphs; inline code, bold, italic, links, bare URLs.

const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*\d{1,9}[.)]\s+(.*)$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
const INLINE = /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|\*(?=[^\s*])([^*]*?[^\s*])\*|\[([^\]\n]+)\]\(([^)\s]+)\)|(https?:\/\/[^\s<>()"']+[^\s<>()"'.,;:!?])/;
const SAFE_PROTOCOLS = new Set(["http:", "https:", "mailto:"]);

/** A DocumentFragment rendering `text` as Markdown. */
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  renderBlocks(text.replace(/\r\n?/g, "\n").split("\n"), fragment);
  return fragment;
}

function renderBlocks(lines, parent) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let match;
    if ((match = FENCE.exec(line))) {
      const fence = match[1];
      const body = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(fence); i++) body.push(lines[i]);
      i++; // the closing fence (or the end)
      parent.append(codeBlock(body.join("\n"), match[2]));
    } else if ((match = HEADING.exec(line))) {
      parent.append(withInline(document.createElement(`h${match[1].length}`), match[2]));
      i++;
    } else if (RULE.test(line)) {
      parent.append(document.createElement("hr"));
      i++;
    } else if (QUOTE.test(line)) {
      const quoted = [];
      for (; i < lines.length && (match = QUOTE.exec(lines[i])); i++) quoted.push(match[1]);
      const quote = document.createElement("blockquote");
      renderBlocks(quoted, quote);
      parent.append(quote);
    } else if (BULLET.test(line) || NUMBERED.test(line)) {
      const pattern = BULLET.test(line) ? BULLET : NUMBERED;
      const list = document.createElement(pattern === BULLET ? "ul" : "ol");
      for (; i < lines.length && (match = pattern.exec(lines[i])); i++) {
        list.append(withInline(document.createElement("li"), match[1]));
      }
      parent.append(list);
    } else if (!line.trim()) {
      i++;
    } else {
      const paragraph = [];
      for (; i < lines.length && lines[i].trim() && !startsBlock(lines[i]); i++) paragraph.push(lines[i]);
      const p = document.createElement("p");
      paragraph.forEach((text, n) => {
        if (n) p.append(document.createElement("br"));
        appendInline(p, text);
      });
      parent.append(p);
    }
  }
}

function startsBlock(line) {
  return [FENCE, HEADING, QUOTE, BULLET, NUMBERED, RULE].some((pattern) => pattern.test(line));
}

function codeBlock(code, language) {
  const pre = document.createElement("pre");
  const element = document.createElement("code");
  if (language) element.dataset.language = language;
  element.textContent = code;
  pre.append(element);
  return pre;
}

function withInline(element, text) {
  appendInline(element, text);
  return element;
}

/** Appends `text` with its inline markup to `parent`, as text nodes and elements only. */
function appendInline(parent, text) {
  let rest = text;
  let match;
  while ((match = INLINE.exec(rest))) {
    if (match.index) parent.append(document.createTextNode(rest.slice(0, match.index)));
    const [whole, , code, bold, italic, label, href, url] = match;
    if (code !== undefined) {
      const element = document.createElement("code");
      element.textContent = code;
      parent.append(element);
    } else if (bold !== undefined) {
      parent.append(withInline(document.createElement("strong"), bold));
    } else if (italic !== undefined) {
      parent.append(withInline(document.createElement("em"), italic));
    } else if (label !== undefined) {
      parent.append(link(href, label) ?? document.createTextNode(whole));
    } else {
      parent.append(link(url, url));
    }
    rest = rest.slice(match.index + whole.length);
  }
  if (rest) parent.append(document.createTextNode(rest));
}

/** An <a> to `href` when it is an http(s) or mailto URL, else null (javascript:, data: ... are not links). */
function link(href, label) {
  let url;
  try {
    url = new URL(href, window.location.href);
  } catch (_) {
    return null;
  }
  if (!SAFE_PROTOCOLS.has(url.protocol)) return null;
  const a = document.createElement("a");
  a.href = url.href;
  a.textContent = label;
  a.target = "_blank";
  a.rel = "noopener noreferrer nofollow";
  return a;
}
