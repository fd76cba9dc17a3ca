"""Every Python code block of README.md and docs/*.md runs as written (issue 34).

Each ```python block runs in a fresh namespace, in a temporary working folder, in this process (a
subprocess per block would pay torch's import each time). The line just before a block's fence may
mark it (an HTML comment, invisible on the rendered page):

* ``<!-- docs-test: skip: REASON -->``: not runnable here (torchrun, several processes); skipped with REASON.
* ``<!-- docs-test: gpu -->``: needs CUDA; skipped without it.
* ``<!-- docs-test: slow -->``: compiles with Inductor and trains (a minute or more on a CPU): runs
  with ``python -m pytest -m slow tests/project/test_docs_code.py``.
"""

import re
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^<!--\s*docs-test:\s*(skip|gpu|slow)\s*(?::\s*(.*?))?\s*-->$")


def python_blocks():
    """``(where, code, mark)`` for every ```python block: where = "file:line of the fence"."""
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
                mark = MARK.match(lines[i - 1].strip()) if i else None
                yield f"{path.relative_to(ROOT)}:{i + 1}", "\n".join(lines[i + 1:end]) + "\n", mark
                i = end
            i += 1


def _params():
    params = []
    for where, code, mark in python_blocks():
        marks = []
        if mark is not None and mark.group(1) == "skip":
            marks.append(pytest.mark.skip(reason=mark.group(2) or "marked skip in the docs"))
        elif mark is not None and mark.group(1) == "gpu":
            marks.append(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))
        elif mark is not None and mark.group(1) == "slow":
            marks.append(pytest.mark.slow)
        params.append(pytest.param(where, code, id=where, marks=marks))
    return params


def test_the_docs_have_python_blocks_and_every_mark_is_known():
    blocks = list(python_blocks())
    assert len(blocks) >= 15 and {w.split(":")[0] for w, _, _ in blocks} >= {"README.md", "docs/backend.md"}
    for path in DOCS:  # a misspelt mark would silently run (or never skip) its block
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "docs-test" in line:
                assert MARK.match(line.strip()), f"{path.name}:{n}: unknown docs-test mark {line!r}"


@pytest.mark.parametrize("where, code", _params())
def test_block_runs_as_written(where, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks write their checkpoints and runs where they stand
    torch._dynamo.reset()
    torch.manual_seed(0)
    namespace = {"__name__": "__main__"}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the docs' own output, not the test's concern
            exec(compile(code, where, "exec"), namespace)
    finally:
        torch._dynamo.reset()
    # it ran to its last line: every name the block binds at top level is there (an exception fails above)
    assert set(_top_level_names(code)) <= set(namespace), f"{where}: names missing after the block ran"


def _top_level_names(code: str) -> list[str]:
    """The names a block assigns, defines or imports at its top level (what running it to the end binds)."""
    import ast

    names = []
    for node in ast.parse(code).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names += [(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"]
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    return names
