"""Every C kernel's ctypes table (`SIGNATURES` in its binding module) against the C source it mirrors.

ctypes trusts `argtypes` blindly: a table one argument short, or an int where the C side reads an int64_t, passes
garbage without an error. So the prototypes are read from the C source here, by a small parser independent of the
tables, and each library is loaded: every table entry must be a symbol of the built library and match its C
definition (argument count, and each type's ctypes equivalent), and every exported (non-static) function of the
source, including what it #includes from its own folder, must have an entry. `test_checker_catches_*` show that the
check itself fails on a wrong table.
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from pagellm.kernels import affinity, decoder, elementwise, linear, paged_attention
from pagellm.kernels.build import included_files

BINDINGS = [linear, elementwise, paged_attention, decoder, affinity]


def _strip(text: str) -> str:
    """C text without comments and preprocessor lines (continuations included), newlines kept."""
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n"), text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", "", text, flags=re.M)


def _inline_local_includes(source: Path, seen: set[Path] | None = None) -> str:
    """The source with each `#include "x"` of a file in its own folder replaced by that file's text, once per file
    (as include guards would), so functions the fragments define count as the source's own."""
    seen = set() if seen is None else seen
    seen.add(source)

    def expand(match: re.Match) -> str:
        path = source.parent / match.group(1)
        return "" if path in seen or not path.is_file() else _inline_local_includes(path, seen)

    return re.sub(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[^\n]*$', expand, source.read_text(), flags=re.M)


def _top_level(text: str) -> str:
    """The text with every brace-enclosed body collapsed to `{}`: what remains are file-scope declarations."""
    out, depth = [], 0
    for char in text:
        if char == "{":
            if depth == 0:
                out.append("{")
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                out.append("}")
        elif depth == 0:
            out.append(char)
    assert depth == 0, "unbalanced braces"
    return "".join(out)


def _split_params(params: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for char in params:
        if char == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
            continue
        depth += char == "("
        depth -= char == ")"
        current.append(char)
    parts.append("".join(current).strip())
    return [] if parts in ([""], ["void"]) else parts


def _object_macros(text: str) -> dict[str, str]:
    """Single-line object-like #defines (`#define ALWAYS_INLINE static inline ...`): a prefix may hide `static`."""
    return dict(re.findall(r"^[ \t]*#[ \t]*define[ \t]+(\w+)(?![\w(])[ \t]*([^\n\\]*)$", text, flags=re.M))


def c_definitions(text: str) -> dict[str, tuple[str, list[str], bool]]:
    """name -> (return type, parameter declarations, static) for every function *defined* (with a body) at file
    scope of the C text. A function defined twice under #if/#else must have the same arity both times."""
    macros = _object_macros(text)
    top = _top_level(_strip(text))
    found: dict[str, tuple[str, list[str], bool]] = {}
    for body in re.finditer(r"\)\s*\{\}", top):
        close, depth = body.start(), 0
        for open_ in range(close, -1, -1):  # the parenthesis that opens the parameter list
            depth += (top[open_] == ")") - (top[open_] == "(")
            if depth == 0:
                break
        name = re.search(r"(\w+)\s*$", top[:open_])
        if name is None:
            continue
        start = max(top.rfind(";", 0, name.start()), top.rfind("}", 0, name.start())) + 1
        prefix = top[start:name.start()]
        for _ in range(4):  # macros within macros
            prefix = re.sub(r"\w+", lambda m: macros.get(m.group(), m.group()), prefix)
        prefix = " ".join(prefix.split())
        static = re.search(r"\bstatic\b", prefix) is not None
        # The return type: the prefix without attributes, qualifiers and macros spelled in capitals (AVX2).
        returns = re.sub(r"__attribute__\s*\(\(.*?\)\)|\b(static|inline|extern|[A-Z][A-Z0-9_]*)\b", " ", prefix)
        params = _split_params(top[open_ + 1:close])
        if name.group(1) in found:
            assert len(found[name.group(1)][1]) == len(params), f"{name.group(1)} defined with two arities"
        found[name.group(1)] = (" ".join(returns.split()), params, static)
    return found


def _ctype_of(declaration: str) -> type | None:
    """The ctypes type a C parameter or return type is passed as (bindings pass every pointer as c_void_p)."""
    if "*" in declaration:
        return ctypes.c_void_p
    words = set(re.findall(r"\w+", declaration)) - {"const", "volatile", "unsigned", "signed"}
    for c_name, ctype in (("void", None), ("int64_t", ctypes.c_int64), ("int32_t", ctypes.c_int32),
                          ("int", ctypes.c_int), ("float", ctypes.c_float), ("double", ctypes.c_double),
                          ("size_t", ctypes.c_size_t)):
        if c_name in words:
            return ctype
    raise AssertionError(f"no ctypes equivalent known for {declaration!r}")


def mismatches(c_text: str, signatures: dict) -> list[str]:
    """Every disagreement between a binding table and the C text it mirrors, in words ([] when they agree)."""
    defined = c_definitions(c_text)
    exported = {name for name, (_, _, static) in defined.items() if not static}
    problems = [f"{name}: exported by the C source but missing from SIGNATURES"
                for name in sorted(exported - set(signatures))]
    for name, (restype, argtypes) in signatures.items():
        if name not in exported:
            problems.append(f"{name}: in SIGNATURES but not an exported function of the C source")
            continue
        returns, params, _ = defined[name]
        if len(argtypes) != len(params):
            problems.append(f"{name}: {len(argtypes)} argtypes, the C prototype takes {len(params)}")
            continue
        if restype is not _ctype_of(returns):
            problems.append(f"{name}: restype {restype}, the C function returns {returns}")
        for i, (argtype, param) in enumerate(zip(argtypes, params)):
            if argtype is not _ctype_of(param):
                problems.append(f"{name}: argument {i} is {argtype.__name__} in SIGNATURES, `{param}` in C")
    return problems


@pytest.mark.parametrize("binding", BINDINGS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_signature_table_matches_the_c_source(binding):
    assert binding.SOURCE.is_file()
    assert mismatches(_inline_local_includes(binding.SOURCE), binding.SIGNATURES) == []


@pytest.mark.parametrize("binding", BINDINGS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_every_table_symbol_is_in_the_built_library(binding):
    library = binding.load()
    assert library is not None, "the C kernels must build on the test machine (gcc is required)"
    for name, (restype, argtypes) in binding.SIGNATURES.items():
        function = getattr(library, name)  # AttributeError: the library lacks it
        assert function.restype is restype and list(function.argtypes) == list(argtypes), f"{name} is not bound"


@pytest.mark.parametrize("binding", BINDINGS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_the_library_exports_nothing_beyond_its_table(binding):
    """The linker's view, independent of the parser: the library's own global functions are the table's."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("needs nm")
    library = binding.load()
    assert library is not None, "the C kernels must build on the test machine (gcc is required)"
    symbols = subprocess.run([nm, "-D", "--defined-only", library._name], capture_output=True, text=True,
                             check=True).stdout
    exported = {line.split()[-1] for line in symbols.splitlines() if line.split()[1:2] == ["T"]}
    exported -= {"_init", "_fini"}
    assert exported == set(binding.SIGNATURES)


def test_every_included_file_is_in_the_cache_key():
    """A source's local #includes are among the files the build hashes, so editing one rebuilds the library."""
    for binding in BINDINGS:
        local = set(re.findall(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', _inline_local_includes(binding.SOURCE),
                               flags=re.M))
        for name in re.findall(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', binding.SOURCE.read_text(), flags=re.M):
            local.add(name)
        assert local <= {path.name for path in included_files(binding.SOURCE)}


_SAMPLE = """
#define LOCAL static inline
typedef struct { int a; } thing;
static int helper(int x) { return x; }
LOCAL int hidden_static(int x) { return x; }
/* int commented_out(void) { } */
#define MACRO(x) static void x##_fn(void) { }
int exported(const thing *t, int64_t n, float scale,
             float *out /* [n] */) { return helper(n); }
void other(void) {}
"""
_SAMPLE_TABLE = {"exported": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p]),
                 "other": (None, [])}


def test_checker_accepts_a_matching_table():
    assert mismatches(_SAMPLE, _SAMPLE_TABLE) == []


def test_checker_catches_a_missing_argument_and_a_missing_entry():
    table = dict(_SAMPLE_TABLE, exported=(ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float]))
    del table["other"]
    problems = mismatches(_SAMPLE, table)
    assert any("exported: 3 argtypes, the C prototype takes 4" in p for p in problems)
    assert any(p.startswith("other: exported by the C source but missing") for p in problems)


def test_checker_catches_a_wrong_type_a_wrong_restype_and_an_unknown_symbol():
    table = dict(_SAMPLE_TABLE, exported=(None, [ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p]),
                 helper=(ctypes.c_int, [ctypes.c_int]))
    problems = mismatches(_SAMPLE, table)
    assert any("exported: restype None" in p for p in problems)
    assert any("exported: argument 1 is c_int in SIGNATURES, `int64_t n` in C" in p for p in problems)
    assert any(p.startswith("helper: in SIGNATURES but not an exported function") for p in problems)


def test_the_package_data_ships_every_kernel_source():
    """pyproject.toml's package-data patterns for pagellm.kernels match every C file there, fragments included, so
    a wheel can build the kernels."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("runs from a source checkout")
    patterns = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["pagellm.kernels"]
    folder = linear.SOURCE.parent
    c_files = {path for path in folder.iterdir() if path.suffix in (".c", ".h", ".inc")}
    assert c_files and c_files <= {path for pattern in patterns for path in folder.glob(pattern)}


@pytest.mark.parametrize("binding", BINDINGS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_checker_catches_each_real_table_with_an_extra_argument_or_a_missing_entry(binding):
    source = _inline_local_includes(binding.SOURCE)
    name, (restype, argtypes) = next(iter(binding.SIGNATURES.items()))
    short = dict(binding.SIGNATURES, **{name: (restype, list(argtypes) + [ctypes.c_int])})
    assert any(p.startswith(f"{name}: {len(argtypes) + 1} argtypes") for p in mismatches(source, short))
    missing = {other: signature for other, signature in binding.SIGNATURES.items() if other != name}
    assert mismatches(source, missing) == [f"{name}: exported by the C source but missing from SIGNATURES"]
