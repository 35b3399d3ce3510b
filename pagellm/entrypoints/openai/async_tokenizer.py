"""Tokenization, detokenization and chat templates for the server, off the event loop: a small thread pool whose
threads each load a tokenizer of their own (a Hugging Face tokenizer must not be used from two threads at once).
A huge prompt then never stalls the event loop, which keeps answering /health and streaming tokens.

It also bounds the work before it starts: no token covers more characters than the longest string in the
vocabulary, so a text longer than that many characters per token is known to be too long without tokenizing it.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pagellm.transformers_utils.tokenizer import get_tokenizer

T = TypeVar("T")

NUM_THREADS = 2
# Vocabulary strings are at least as long as the text their tokens stand for (byte-level BPE: one character per
# byte); the factor leaves room for normalizers that shorten text (NFKC, combining characters).
_NORMALIZER_SLACK = 2


class AsyncTokenizer:
    def __init__(self, tokenizer_name: str, chat_template: str | None = None) -> None:
        self._tokenizer_name = tokenizer_name
        self.chat_template = chat_template
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(NUM_THREADS, thread_name_prefix="pagellm-tokenizer")
        tokenizer = get_tokenizer(tokenizer_name)  # loaded here too, so a broken tokenizer fails at start-up
        self.has_chat_template = chat_template is not None or bool(getattr(tokenizer, "chat_template", None))
        # The template's source, to tell which chat_template_kwargs it reads (a tokenizer may hold several, by name).
        template_source = chat_template or getattr(tokenizer, "chat_template", None) or ""
        self.chat_template_source = template_source if isinstance(template_source, str) else str(template_source)
        self.supports_tools = self.has_chat_template and _renders_tools(tokenizer, chat_template)
        self.max_chars_per_token = _NORMALIZER_SLACK * max(map(len, tokenizer.get_vocab()))

    def _tokenizer(self):
        if not hasattr(self._local, "tokenizer"):
            self._local.tokenizer = get_tokenizer(self._tokenizer_name)
        return self._local.tokenizer

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens `text` encodes to, without encoding it."""
        return -(-len(text) // self.max_chars_per_token)

    async def _run(self, method: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        def call() -> T:
            return method(self._tokenizer(), *args, **kwargs)

        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self._run(_encode, text, add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        return await self._run(_decode, token_ids)

    async def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return await self._run(_convert_ids_to_tokens, token_ids)

    async def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None,
                          continue_final_message: bool = False) -> str:
        """The chat template (the server's --chat-template, else the tokenizer's) applied to `messages` and
        `tools`, as text; `template_kwargs` become the template's variables (vLLM's chat_template_kwargs);
        `continue_final_message` leaves the last message open for the model to continue (transformers'; a
        ValueError when the template does not end with it). transformers renders it in a sandboxed Jinja
        environment; template errors raise jinja2's TemplateError."""
        return await self._run(_render_chat, messages, self.chat_template, add_generation_prompt, tools,
                               continue_final_message, **(template_kwargs or {}))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _decode(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids)


def _convert_ids_to_tokens(tokenizer, token_ids: list[int]) -> list[str]:
    return tokenizer.convert_ids_to_tokens(token_ids)


def _render_chat(tokenizer, messages: list[dict[str, Any]], chat_template: str | None,
                 add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None,
                 continue_final_message: bool = False, **template_kwargs: Any) -> str:
    return tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, tools=tools,
                                         continue_final_message=continue_final_message, **template_kwargs)


_PROBE_TOOL = {"type": "function", "function": {"name": "pagellm_probe_tool", "parameters": {"type": "object"}}}


def _renders_tools(tokenizer, chat_template: str | None) -> bool:
    """Whether the chat template shows tools to the model (tool_choice "auto" parses calls only then)."""
    messages = [{"role": "user", "content": "hi"}]
    try:
        return "pagellm_probe_tool" in _render_chat(tokenizer, messages, chat_template, True, [_PROBE_TOOL])
    except Exception:  # a template that cannot render this probe cannot be relied on for tools either
        return False
