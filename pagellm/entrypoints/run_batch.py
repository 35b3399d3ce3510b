"""`pagellm run-batch -i requests.jsonl -o results.jsonl`: OpenAI's batch file format, as vLLM's `run-batch`. Each
line is dispatched through the OpenAI server's own app in process (batch_jobs.py), so any endpoint the server has
works; lines run concurrently so that the engine batches them. Resumable: custom_ids already in the output file are
skipped and new lines appended. Input and output are local paths (vLLM also takes URLs)."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from tqdm import tqdm

from pagellm.engine.arg_utils import EngineArgs
from pagellm.entrypoints.openai.batch_jobs import DEFAULT_BATCH_CONCURRENCY, BatchDispatcher


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input-file", required=True, help="batch input: a local JSONL path")
    parser.add_argument("-o", "--output-file", required=True,
                        help="batch output: a local JSONL path, appended to (its custom_ids are skipped)")
    parser.add_argument("--max-concurrency", type=int, default=DEFAULT_BATCH_CONCURRENCY,
                        help="lines in flight at once")
    parser.add_argument("--served-model-name", dest="served_model_names", nargs="+", default=None,
                        help="the model names the lines' bodies may use (default: the model's path)")
    parser.add_argument("--chat-template", default=None, help="a file path or the template itself")
    parser.add_argument("--disable-progress-bar", action="store_true")
    EngineArgs.add_cli_args(parser)


def _done_custom_ids(output: Path) -> set[str]:
    """The custom_ids the output file already answers (a torn last line from an interrupted run is ignored)."""
    done: set[str] = set()
    if output.exists():
        for text in output.read_text().splitlines():
            try:
                custom_id = json.loads(text).get("custom_id")
            except (json.JSONDecodeError, AttributeError):
                continue
            if isinstance(custom_id, str):
                done.add(custom_id)
    return done


def _pending(lines: list[str], done: set[str]) -> list[str]:
    pending = []
    for text in lines:
        try:
            custom_id = json.loads(text).get("custom_id")
        except (json.JSONDecodeError, AttributeError):
            custom_id = None
        if custom_id not in done:
            pending.append(text)
    return pending


async def _run(dispatcher: BatchDispatcher, lines: list[str], output: Path, progress: tqdm) -> None:
    with output.open("a") as out:
        async for result in dispatcher.run(lines):
            out.write(result.model_dump_json() + "\n")
            out.flush()  # written as it finishes, so an interrupted run resumes after it
            progress.update()


def run_batch(args: argparse.Namespace) -> int:
    from pagellm.engine.async_llm import AsyncLLM
    from pagellm.entrypoints.openai.api_server import ServerConfig, build_app
    from pagellm.entrypoints.openai.routes.state import server_state

    if args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}.")
    source, output = Path(args.input_file), Path(args.output_file)
    lines = [text for text in source.read_text().splitlines() if text.strip()]
    done = _done_custom_ids(output)
    pending = _pending(lines, done)
    print(f"{len(lines)} lines, {len(lines) - len(pending)} already in {output}, {len(pending)} to run",
          file=sys.stderr)
    if not pending:
        return 0
    engine_args = EngineArgs.from_cli_args(args)
    if args.served_model_names:
        engine_args.served_model_name = args.served_model_names[0]
    engine = AsyncLLM.from_engine_args(engine_args, log_stats=False)
    try:
        app = build_app(engine, ServerConfig(served_model_names=args.served_model_names or [
                                                 engine.config.model_config.served_model_name],
                                             chat_template=args.chat_template))
        dispatcher = BatchDispatcher(app, max_concurrency=args.max_concurrency)
        with tqdm(total=len(pending), desc="run-batch", unit="req", file=sys.stderr,
                  disable=args.disable_progress_bar) as progress:
            try:
                asyncio.run(_run(dispatcher, pending, output, progress))
            finally:
                server_state(app).tokenizer.shutdown()
    finally:
        engine.shutdown()
    return 0
