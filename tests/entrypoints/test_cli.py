"""The command line: the documented flag lists (README.md, docs/usage.md, docs/serving.md) against the parsers,
both ways (every flag of `pagellm serve` and `pagellm generate` is documented, and every flag the engine and server
paragraphs name exists), and no benchmark module loaded unless a benchmark runs."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from pagellm.entrypoints.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "docs" / "usage.md", ROOT / "docs" / "serving.md"]
# The paragraphs that list pagellm's own flags (other paragraphs quote llama.cpp's and guidellm's).
FLAG_PARAGRAPHS = ("Engine flags use vLLM's names:", "An OpenAI-compatible server (FastAPI + uvicorn, in-process)")


def _long_options(command: str) -> set[str]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {option for action in commands.choices[command]._actions for option in action.option_strings
            if option.startswith("--") and option != "--help"}


def _paragraph(text: str, start: str) -> str:
    begin = text.index(start)
    return text[begin:text.index("\n\n", begin)]


def _docs_text() -> str:
    return "\n\n".join(path.read_text() for path in DOCS)


def test_every_flag_is_documented():
    text = _docs_text()
    for command in ("serve", "generate"):
        missing = [option for option in sorted(_long_options(command)) if not option.startswith("--no-")
                   and option not in text and f"--[no-]{option[2:]}" not in text]
        assert not missing, f"pagellm {command}: {missing} are not documented"


def test_every_documented_flag_exists():
    text = _docs_text()
    options = _long_options("serve") | _long_options("generate")
    for start in FLAG_PARAGRAPHS:
        named = {"--" + name for name in re.findall(r"`--(?:\[no-\])?([a-z][a-z0-9-]*)", _paragraph(text, start))}
        assert named, start
        assert named <= options, f"the docs name flags that pagellm lacks: {sorted(named - options)}"


def test_benchmarks_are_imported_only_when_one_runs():
    script = ("import sys; from pagellm.entrypoints.cli import build_parser\n"
              "for argv in (['serve'], ['generate', 'x'], ['--help'], ['bench']): build_parser(argv)\n"
              "print(sorted(m for m in sys.modules if m.startswith('pagellm.benchmarks')))\n"
              "build_parser(['bench', 'structured'])\n"
              "print(sorted(m for m in sys.modules if m.startswith('pagellm.benchmarks')))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    lines = result.stdout.split("\n")
    assert lines[0] == "[]"
    assert "pagellm.benchmarks.structured" in lines[1]
