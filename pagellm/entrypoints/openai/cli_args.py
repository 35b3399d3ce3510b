"""The flags of `pagellm serve` (vLLM's names): server settings plus every engine flag."""
from __future__ import annotations

import argparse

from pagellm.engine.arg_utils import EngineArgs, parse_size
from pagellm.entrypoints.openai.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES
from pagellm.entrypoints.openai.protocol_responses_api import DEFAULT_MAX_STORED_RESPONSES


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="checkpoint directory, .gguf file or hub id (same as --model)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer <key>' on /v1/*, /tokenize and /detokenize "
                             "(default: $PAGELLM_API_KEY; none: open)")
    parser.add_argument("--served-model-name", dest="served_model_names", nargs="+", default=None,
                        help="model name(s) the API accepts; the first is reported (default: --model)")
    parser.add_argument("--chat-template", default=None,
                        help="chat template file or inline Jinja template (default: the tokenizer's)")
    parser.add_argument("--max-waiting-requests", type=int, default=None,
                        help="answer 503 with Retry-After when this many requests are already waiting "
                             "(default: unbounded)")
    parser.add_argument("--max-request-body-bytes", type=parse_size, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="answer 413 to a request body larger than this, e.g. 16MiB (default: 16MiB)")
    parser.add_argument("--max-stored-responses", type=_non_negative_int, default=DEFAULT_MAX_STORED_RESPONSES,
                        help="/v1/responses keeps this many `store: true` responses in memory, the least recently "
                             "used dropped first (default: %(default)s)")
    parser.add_argument("--disable-log-stats", action="store_true", help="no periodic stats log line")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    return EngineArgs.add_cli_args(parser)
