"""Every `# type: ignore` names its error codes and says why on its own line:
`# type: ignore[arg-type]  # pulumi's Input[...] is invariant`. mypy (warn_unused_ignores, ignore-without-code) and
ruff (PGH003) check the first half; a reason is checked here. Files ruff does not lint yet (pyproject.toml's
per-file-ignores of "ALL") are left out, as ruff leaves them."""

from __future__ import annotations

import fnmatch
import io
import re
import tokenize
import tomllib

import pytest

from conftest import ROOT

# The ignore, its codes, then a comment of its own with some text: the reason.
EXPLAINED = re.compile(r"type:\s*ignore\[[\w\-, ]+\]\s+#\s*\S")


def unexplained(source: str) -> list[int]:
    """The lines of `source` whose type-ignore comment gives no codes or no reason (comments only, not strings)."""
    return [token.start[0] for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type == tokenize.COMMENT and re.search(r"type:\s*ignore", token.string)
            and not EXPLAINED.search(token.string)]


def not_linted() -> list[str]:
    """The path patterns pyproject.toml keeps from ruff altogether, relative to the checkout."""
    ruff = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    return [pattern.removeprefix("./") for pattern, rules in ruff.get("per-file-ignores", {}).items()
            if rules == ["ALL"]]


def test_every_type_ignore_says_why() -> None:
    skipped = not_linted()
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if any(part.startswith(".") or part == "__pycache__" for part in path.relative_to(ROOT).parts):
            continue
        if any(fnmatch.fnmatch(relative, pattern) for pattern in skipped):
            continue
        found += [f"{relative}:{line}" for line in unexplained(path.read_text())]
    assert not found, "type-ignore without its codes and a reason after them:\n" + "\n".join(found)


@pytest.mark.parametrize(("source", "lines"), [
    ("x: int = f()  # type: ignore[assignment]  # f's stub says str, it returns int\n", []),
    ("x: int = f()  # type: ignore[assignment]\n", [1]),
    ("x: int = f()  # type: ignore[assignment]  #\n", [1]),
    ("x: int = f()  # type: ignore  # f's stub says str\n", [1]),
    ("x = 1\ny: int = f()  # noqa: E501  # type: ignore[assignment]\n", [2]),
    ('text = "# type: ignore"\n', []),
])
def test_a_type_ignore_without_a_reason_is_found(source: str, lines: list[int]) -> None:
    assert unexplained(source) == lines
