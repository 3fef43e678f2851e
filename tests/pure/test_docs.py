"""The docs say what the code does: Notes, counts, paths and names checked against the code, with no process.

* the Notes index of docs/architecture.md is the set of Notes the code defines (name and file), and every
  ``Note [...]`` reference, in code, tests or docs, names a Note defined once;
* counts the docs quote are counted in the code: the Notes, the parity cases of docs/eager-ddp.md (read from
  tests/spawned/test_parity.py with ``ast``, never imported), the PyTorch tests the README says run by substitution;
* every repository path the docs name exists, and every ``graphddp.x.y`` name they use is defined.

Each check is a function returning the problems it finds; ``test_the_checks_see_a_wrong_doc`` feeds each one a
doc that disagrees with the code, so a check that found nothing would fail there.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE = ("graphddp", "passes")
"""Where Notes are defined."""
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

NOTE_DEFINITION = re.compile(r"^Note \[([^\]]+)\]$", re.MULTILINE)
"""A Note is defined by a docstring line of its own (``~~~`` under it), as in PyTorch."""
NOTE_REFERENCE = re.compile(r"Note(?:\s|#)+\[([^\[\]]+)\]")
"""A reference may break across lines, in prose or in ``#`` comments."""
INDEX_ROW = re.compile(r"^\| \[([^\]]+)\] \| `([^`]+)` \|", re.MULTILINE)
REPO_PATH = re.compile(r"(?<![\w./-])((?:graphddp|passes|bench|tests|docs)/[\w./-]*\w)")
LAYER_PATH = re.compile(r"(?<![\w./-])((?:runtime|compiler|integrations|tools)/\w+\.py)")
"""Short paths inside the package (``runtime/buckets.py``): under ``graphddp/``."""
DOTTED_NAME = re.compile(r"(?<![\w.])(graphddp(?:\.\w+)+)")


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


# -- Notes -------------------------------------------------------------------------------------------------------
def note_definitions(texts: dict[str, str]) -> dict[str, list[str]]:
    """Each Note's name and the files defining it (a list: a Note defined twice is a problem)."""
    defined: dict[str, list[str]] = {}
    for file, text in texts.items():
        for name in NOTE_DEFINITION.findall(text):
            defined.setdefault(name, []).append(file)
    return defined


def note_references(text: str) -> set[str]:
    """The names of the Notes ``text`` refers to, line breaks and comment markers inside a name folded away."""
    return {" ".join(word for word in name.split() if word != "#") for name in NOTE_REFERENCE.findall(text)}


def definition_problems(defined: dict[str, list[str]]) -> list[str]:
    return [f"Note [{name}] is defined {len(files)} times: {files}" for name, files in defined.items() if files[1:]]


def index_problems(index_markdown: str, defined: dict[str, list[str]]) -> list[str]:
    """The index's rows against the definitions: the same Notes, each with the file that defines it."""
    listed = INDEX_ROW.findall(index_markdown)
    names = [name for name, _ in listed]
    twice = sorted({name for name in names if names.count(name) > 1})
    problems = [f"Note [{name}] is listed {names.count(name)} times" for name in twice]
    index = dict(listed)
    for name, files in sorted(defined.items()):
        if name not in index:
            problems.append(f"Note [{name}] ({files[0]}) is missing from the index")
        elif index[name] not in files:
            problems.append(f"Note [{name}] is indexed in {index[name]}, defined in {files[0]}")
    problems += [f"Note [{name}] is indexed but defined nowhere" for name in sorted(set(index) - set(defined))]
    return problems


def reference_problems(texts: dict[str, str], defined: Iterable[str]) -> list[str]:
    known = set(defined)
    return [
        f"{file} refers to Note [{name}], which no file defines"
        for file, text in sorted(texts.items())
        for name in sorted(note_references(text) - known)
    ]


# -- counts -----------------------------------------------------------------------------------------------------
def quoted(pattern: str, text: str) -> list[int]:
    return [int(n) for n in re.findall(pattern, text)]


def count_problems(what: str, pattern: str, text: str, actual: int, *, required: bool = True) -> list[str]:
    """Every number ``pattern`` captures in ``text`` equals ``actual`` (and, if ``required``, one is there)."""
    found = quoted(pattern, text)
    if required and not found:
        return [f"{what}: no count matching {pattern!r} is quoted any more (keep the check in step with the doc)"]
    return [f"{what}: the doc says {n}, the code has {actual}" for n in found if n != actual]


def literal_keys(source: str, name: str) -> list[str]:
    """The keys of the dict literal assigned to ``name`` at the top of a module (``ast``: nothing is imported)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            if isinstance(node.value, ast.Dict):
                return [ast.literal_eval(key) for key in node.value.keys if key is not None]
            if isinstance(node.value, (ast.List, ast.Tuple)):
                return [ast.literal_eval(item) for item in node.value.elts]
    raise AssertionError(f"no literal {name} = {{...}} / [...] at the top of the module")


def parity_cases(source: str) -> tuple[int, int]:
    """(cases run × SGD/Adam × 2 and 3 ranks, sparse-gradient cases) of tests/spawned/test_parity.py."""
    cases, sparse = set(literal_keys(source, "CASES")), set(literal_keys(source, "SPARSE_CASES"))
    return len(cases - sparse), len(sparse)


# -- paths and names --------------------------------------------------------------------------------------------
def path_problems(file: str, text: str) -> list[str]:
    paths = sorted(set(REPO_PATH.findall(text)))
    problems = [f"{file} names {p}, which does not exist" for p in paths if not (ROOT / p).exists()]
    problems += [
        f"{file} names {p}, which is not graphddp/{p}"
        for p in sorted(set(LAYER_PATH.findall(text)))
        if not (ROOT / "graphddp" / p).exists()
    ]
    return problems


def module_file(module: str) -> Path | None:
    """The file of a graphddp module (``graphddp.passes`` lives in ``passes/``, ``graphddp.bench`` in ``bench/``:
    pyproject's package-dir), None if there is none."""
    parts = module.split(".")
    mapped = len(parts) > 1 and parts[0] == "graphddp" and parts[1] in ("passes", "bench")
    base = ROOT / parts[1] if mapped else ROOT / "graphddp"
    rest = parts[2:] if mapped else parts[1:]
    for candidate in (base.joinpath(*rest).with_suffix(".py"), base.joinpath(*rest, "__init__.py")):
        if rest and candidate.exists():
            return candidate
    return base / "__init__.py" if not rest else None


def top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(read(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):  # lazily loaded (PEP 562)
                names.update(e.value for e in getattr(node.value, "elts", ()) if isinstance(e, ast.Constant))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def name_problems(file: str, text: str) -> list[str]:
    """``graphddp.a.b.c``: the longest prefix that is a module exists, and the next name is defined in it."""
    problems = []
    for dotted in sorted(set(DOTTED_NAME.findall(text))):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            path = module_file(".".join(parts[:cut]))
            if path is not None:
                break
        rest = parts[cut:]
        if rest and rest[0] not in top_level_names(path) and module_file(".".join(parts[: cut + 1])) is None:
            problems.append(f"{file} names {dotted}: {relative(path)} defines no {rest[0]}")
    return problems


# -- the checks --------------------------------------------------------------------------------------------------
def code_texts() -> dict[str, str]:
    return {relative(p): read(p) for p in python_files(*CODE)}


def referring_texts() -> dict[str, str]:
    """Everything that may refer to a Note: code, tests, the benchmark, the docs (this file's examples aside)."""
    files = [p for p in python_files(*CODE, "bench", "tests") if p != Path(__file__).resolve()] + DOCS
    return {relative(p): read(p) for p in files}


def test_each_note_is_defined_once() -> None:
    defined = note_definitions(code_texts())
    assert len(defined) >= 16
    assert not definition_problems(defined)


def test_the_notes_index_is_the_notes_the_code_defines() -> None:
    problems = index_problems(read(ROOT / "docs" / "architecture.md"), note_definitions(code_texts()))
    assert not problems, "docs/architecture.md, Notes index:\n" + "\n".join(problems)


def test_every_note_referred_to_is_defined() -> None:
    problems = reference_problems(referring_texts(), note_definitions(code_texts()))
    assert not problems, "\n".join(problems)


def test_counts_quoted_in_the_docs_are_the_codes() -> None:
    notes = len(note_definitions(code_texts()))
    dense, sparse = parity_cases(read(ROOT / "tests" / "spawned" / "test_parity.py"))
    conformance = read(ROOT / "tests" / "conformance" / "test_torch_ddp_suite.py")
    included = len(literal_keys(conformance, "INCLUDED"))
    expected_failures = len(literal_keys(conformance, "RELIES_ON_TORCH_INTERNALS"))
    architecture, readme = read(ROOT / "docs" / "architecture.md"), read(ROOT / "README.md")
    eager = read(ROOT / "docs" / "eager-ddp.md")
    problems = count_problems("Notes (docs/architecture.md)", r"\b(\d+) Notes\b", architecture, notes)
    for doc in DOCS:  # any other doc that counts them
        if doc.name != "architecture.md":
            problems += count_problems(f"Notes ({relative(doc)})", r"\b(\d+) Notes\b", read(doc), notes, required=False)
    problems += count_problems("parity cases (docs/eager-ddp.md)", r"(\d+) cases × SGD/Adam", eager, dense)
    problems += count_problems("sparse parity cases (docs/eager-ddp.md)", r"(\d+) sparse-gradient cases", eager, sparse)
    problems += count_problems("PyTorch's DDP tests (README)", r"the (\d+) that build a DDP on CPU", readme, included)
    passing = included - expected_failures
    problems += count_problems("PyTorch's DDP tests passing (README)", r"(\d+) pass under graphddp", readme, passing)
    assert not problems, "\n".join(problems)


def test_paths_and_names_in_the_docs_exist() -> None:
    problems = []
    for doc in DOCS:
        text = read(doc)
        problems += path_problems(relative(doc), text) + name_problems(relative(doc), text)
    assert not problems, "\n".join(problems)


def test_the_checks_see_a_wrong_doc() -> None:
    """Each check above, fed a doc that disagrees with the code, reports it (else they prove nothing)."""
    defined = {"Bucket plan": ["passes/plan.py"], "Reducer": ["graphddp/runtime/reducer.py"]}
    right = "| [Bucket plan] | `passes/plan.py` | ... |\n| [Reducer] | `graphddp/runtime/reducer.py` | ... |\n"
    assert not index_problems(right, defined)
    assert index_problems(right.replace("runtime/reducer", "runtime/plans"), defined)  # the wrong file
    assert index_problems(right.split("\n")[0], defined)  # a Note missing
    assert index_problems(right + "| [Gone] | `passes/gone.py` | ... |\n", defined)  # a Note indexed, never defined
    assert definition_problems({"Reducer": ["a.py", "b.py"]})

    wrapped = "see (Note\n    # [Bucket\n    # plan]) and Note [Reducer]"
    assert note_references(wrapped) == {"Bucket plan", "Reducer"}
    assert not reference_problems({"a.py": wrapped}, defined)
    assert reference_problems({"a.py": wrapped + " (Note [Bucket lifecycle])"}, defined)

    assert not count_problems("cases", r"(\d+) cases × SGD/Adam", "19 cases × SGD/Adam", 19)
    assert count_problems("cases", r"(\d+) cases × SGD/Adam", "16 cases × SGD/Adam", 19)
    assert count_problems("cases", r"(\d+) cases × SGD/Adam", "every case × SGD/Adam", 19)  # the count went away
    source = "CASES = {'a': 1, 'b': 2, 'c': 3}\nSPARSE_CASES = {'c': 3}\nCASES.update(SPARSE_CASES)\n"
    assert parity_cases(source) == (2, 1)

    assert not path_problems("doc", "`graphddp/runtime/reducer.py`, `runtime/plans.py`, `tests/pure/`")
    assert path_problems("doc", "`graphddp/reducer.py`")  # a module that moved
    assert path_problems("doc", "`runtime/cli.py`")
    assert not name_problems("doc", "`graphddp.runtime.trace.EventLog`, `graphddp.passes.BucketPlan`, `graphddp.DDP`")
    assert name_problems("doc", "`graphddp.runtime.trace.NoSuchLog`")
    assert name_problems("doc", "`graphddp.launch.init_process_group`")
