// One streamed answer from POST /v1/chat/completions, with what the page shows under it: prompt and output tokens
// and cached prompt tokens (from the usage the server sends last, with stream_options.include_usage), time to the
// first token, output tokens per second after it, and the finish reason.

import { apiFetch, errorMessage, readEvents } from "./api.js";

/** The request body: only the settings the user filled in, so the server's defaults apply to the rest. */
export function requestBody(model, messages, settings) {
  const body = { model, messages, stream: true, stream_options: { include_usage: true } };
  for (const [field, parse] of [["temperature", Number], ["top_p", Number], ["max_tokens", Number],
    ["seed", Number]]) {
    const value = settings[field];
    if (value !== undefined && value !== null && value !== "") body[field] = parse(value);
  }
  return body;
}

/**
 * Streams the answer, calling onText(all text so far) as it grows. Resolves to
 * {text, stats: {prompt_tokens, completion_tokens, cached_tokens, ttft_ms, tokens_per_s, finish_reason}}; a stop
 * (signal aborted) resolves with finish_reason "stopped" and what arrived before it. Errors reject with the
 * server's message.
 */
export async function streamChat(body, signal, onText) {
  const started = performance.now();
  let firstTokenAt = null;
  let text = "";
  let usage = null;
  let finishReason = null;
  let chunks = 0;
  const response = await apiFetch("/v1/chat/completions", {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal,
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  try {
    await readEvents(response, (event) => {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) usage = event.usage;
      for (const choice of event.choices || []) {
        const delta = choice.delta?.content;
        if (delta) {
          firstTokenAt ??= performance.now();
          chunks += 1;
          text += delta;
          onText(text);
        }
        if (choice.finish_reason) finishReason = choice.finish_reason;
      }
    });
  } catch (error) {
    if (error.name !== "AbortError") throw error;
    finishReason = "stopped";
  }
  const ended = performance.now();
  const outputTokens = usage ? usage.completion_tokens : null;
  // Decode speed: the tokens after the first over the time after the first (TTFT is shown on its own).
  const decodeTokens = (outputTokens ?? chunks) - 1;
  const decodeSeconds = firstTokenAt === null ? 0 : (ended - firstTokenAt) / 1000;
  return {
    text,
    stats: {
      prompt_tokens: usage ? usage.prompt_tokens : null,
      completion_tokens: outputTokens,
      cached_tokens: usage ? (usage.prompt_tokens_details?.cached_tokens ?? 0) : null,
      ttft_ms: firstTokenAt === null ? null : Math.round(firstTokenAt - started),
      tokens_per_s: decodeTokens > 0 && decodeSeconds > 0 ? decodeTokens / decodeSeconds : null,
      finish_reason: finishReason,
    },
  };
}

/** The line under an answer, e.g. "prompt 31 tok (16 cached) · output 24 tok · TTFT 85 ms · 41.2 tok/s · stop". */
export function formatStats(stats) {
  const parts = [];
  if (stats.prompt_tokens !== null) {
    parts.push(`prompt ${stats.prompt_tokens} tok (${stats.cached_tokens} cached)`);
  }
  if (stats.completion_tokens !== null) parts.push(`output ${stats.completion_tokens} tok`);
  if (stats.ttft_ms !== null) parts.push(`TTFT ${stats.ttft_ms} ms`);
  if (stats.tokens_per_s !== null) parts.push(`${stats.tokens_per_s.toFixed(1)} tok/s`);
  parts.push(`finish: ${stats.finish_reason ?? "unknown"}`);
  return parts.join(" · ");
}
