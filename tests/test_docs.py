"""The docs tell the truth about the code: the generated reference pages are what the generator makes of the code
today, and every command in the tutorials is one the tests run.

A tutorial's shell block says where it runs, in its title, one of PLACES:
- "Your machine (no AWS)": this test runs the page's blocks, in order, in a scratch copy of the repository, and each
  must exit 0;
- "Head node": each command's program, options and keywords are those of a command the local-cluster tests
  (tests/integration) run, and each example it submits is one they submit;
- "Your machine (AWS credentials)": only AWS can run these, so they are exactly the README's real path, no more and
  no fewer (the README's blocks carry the same titles).
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import docgen
from conftest import ALL_STACK_FILES, ROOT, planned

DOCS = ROOT / "docs"
README = ROOT / "README.md"
TUTORIALS = sorted((DOCS / "tutorials").glob("*.md"))
OFFLINE, AWS, CLUSTER = "Your machine (no AWS)", "Your machine (AWS credentials)", "Head node"
PLACES = (OFFLINE, AWS, CLUSTER)
SHELL = ("sh", "bash", "console", "shell")
# Shell plumbing on the head node, not a cluster command.
PLUMBING = {"cd", "cat", "cp", "mkdir"}
README_MAX_LINES = 150
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w*)(?P<info>[^\n]*)\n(?P<body>.*?)^(?P=indent)```$", re.M | re.S)


def shell_blocks(path: Path) -> list[tuple[str | None, str]]:
    """(title, text) of every shell block of a Markdown file, in order."""
    blocks = []
    for match in FENCE.finditer(path.read_text()):
        if match["lang"] in SHELL:
            title = re.search(r'title="([^"]*)"', match["info"])
            body = "\n".join(line.removeprefix(match["indent"]) for line in match["body"].splitlines())
            blocks.append((title[1] if title else None, body))
    return blocks


def commands(block: str) -> list[list[str]]:
    """The block's commands as words, comments dropped and continued lines joined."""
    return [words for line in block.replace("\\\n", " ").splitlines() if (words := shlex.split(line, comments=True))]


def tutorial_commands(place: str) -> list[list[str]]:
    return [c for page in TUTORIALS for title, text in shell_blocks(page) if title == place for c in commands(text)]


@pytest.mark.parametrize("page", list(docgen.PAGES), ids=lambda p: p.name)
def test_generated_reference_pages_match_the_code(page: Path) -> None:
    """Regenerate with GPUCLUSTER_UPDATE_GOLDEN=1 and read the diff."""
    text = docgen.PAGES[page]()
    if os.environ.get("GPUCLUSTER_UPDATE_GOLDEN"):
        page.write_text(text)
    assert page.read_text() == text, f"{page.relative_to(ROOT)} is stale: {docgen.REGENERATE}"


def test_the_command_prints_the_help_the_cli_page_shows() -> None:
    """The page's help is made in-process (docgen.help_text); one real process of the entry point prints the same."""
    assert docgen.help_printed("plan") == docgen.help_text("plan")
    assert docgen.help_printed() == docgen.help_text()


def test_every_stack_key_has_a_row_with_its_description() -> None:
    page = docgen.STACK_FILE_PAGE.read_text()
    keys = list(docgen.keys())
    assert len(keys) > 40  # the walk reaches the nested sections, not only the top
    for key in keys:
        leaf = key.path.rsplit(".", 1)[-1]
        assert re.search(rf"^\| \[?`{re.escape(leaf)}`.*\| {re.escape(docgen._cell(key.description))} \|$", page,
                         re.M), key.path


def test_the_generator_refuses_an_undocumented_key() -> None:
    from pydantic import BaseModel

    class Undocumented(BaseModel):
        # A key with its comment.
        documented: int = 0
        bare: int = 0

    with pytest.raises(ValueError, match=r"Undocumented.bare \(x.bare\) has no description"):
        list(docgen.keys(Undocumented, "x."))


def test_the_verify_page_refuses_a_check_without_its_comment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks' descriptions are the comments beside their constants in contract/verify.py: a check named in the
    contract without one is an error, not a row without a description."""
    from gpucluster.contract import verify

    assert set(docgen.check_descriptions()) == set(verify.CHECK_NAMES)
    monkeypatch.setattr(verify, "CHECK_NAMES", (*verify.CHECK_NAMES, "undocumented_check"))
    with pytest.raises(ValueError, match="undocumented_check"):
        docgen.check_descriptions()


def test_what_a_stack_creates_names_every_component_of_the_shipped_stacks() -> None:
    page = (DOCS / "reference" / "what-a-stack-creates.md").read_text()
    components = {d.type for path in ALL_STACK_FILES for d in planned(path)[1] if d.type.startswith("gpucluster:")}
    assert components and not {c for c in components if f"`{c}`" not in page}


def test_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


@pytest.mark.parametrize("page", TUTORIALS, ids=lambda p: p.name)
def test_every_tutorial_shell_block_says_where_it_runs(page: Path) -> None:
    assert all(title in PLACES for title, _ in shell_blocks(page)), [t for t, _ in shell_blocks(page)]


def scratch_checkout(into: Path) -> Path:
    """A copy of the repository's files whose .venv runs this interpreter, installed as far as `make` can tell: its
    `gpucluster` and `activate` stand in for what pip's install of the checkout writes (tests/test_package.py proves
    that install), as this venv is not made by make."""
    skip = shutil.ignore_patterns(".venv", ".git", "site", "__pycache__", ".pytest_cache", "build", "out")
    repo = Path(shutil.copytree(ROOT, into / "repo", ignore=skip))
    python = repo / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    python.chmod(0o755)
    command = repo / ".venv" / "bin" / "gpucluster"
    command.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m gpucluster "$@"\n')
    command.chmod(0o755)
    (repo / ".venv" / "bin" / "activate").write_text(f'PATH={shlex.quote(str(python.parent))}:"$PATH"\n')
    for stamp in (".runtime", ".installed"):
        (repo / ".venv" / stamp).touch()
    return repo


@pytest.mark.parametrize("page", [p for p in TUTORIALS if any(t == OFFLINE for t, _ in shell_blocks(p))],
                         ids=lambda p: p.name)
def test_offline_tutorial_commands_run(page: Path, tmp_path: Path) -> None:
    repo = scratch_checkout(tmp_path)
    for title, block in shell_blocks(page):
        if title == OFFLINE:
            done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=repo, capture_output=True, text=True,
                                  timeout=600)
            assert done.returncode == 0, f"{page.name}:\n{block}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"


def integration_commands() -> list[tuple[str, ...]]:
    """What the local-cluster tests run: the string constants of each call (cluster.run("sinfo", "-R", ...),
    submit_example(cluster, "ddp.sbatch", ...)) and each list (["sbatch", "--parsable", "-p", ...]), in order."""
    found = []
    for path in sorted((ROOT / "tests" / "integration").glob("*.py")) + [ROOT / "tests" / "local_cluster.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            parts = node.args if isinstance(node, ast.Call) else node.elts if isinstance(node, ast.List) else []
            words = tuple(p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str))
            if words:
                found.append(words)
    return found


def options(words: list[str] | tuple[str, ...]) -> set[str]:
    return {w.split("=", 1)[0] for w in words if w.startswith("-")}


def keywords(words: list[str] | tuple[str, ...]) -> set[str]:
    """Subcommands and keywords (`show`, `job`): plain lowercase words, not values such as paths or partitions."""
    return {w for w in words[1:] if re.fullmatch(r"[a-z]+", w)}


def run_by_the_cluster_tests(words: list[str], ran: list[tuple[str, ...]]) -> bool:
    if words[0] == "sudo":
        words = words[1:]
    if words[0] in PLUMBING:
        return True
    examples = [w for w in words if w.startswith("examples/")]
    if examples and not all(any(e in r or Path(e).name in r for r in ran) and (ROOT / e).is_file() for e in examples):
        return False
    rest = [w for w in words if w not in examples]
    if words[0] in examples:  # an example that is itself the command (examples/submit.sh), with options a test gives
        return any(words[0] in r and options(rest) <= options(r) for r in ran)
    return any(r[0] == rest[0] and options(rest) <= options(r) and keywords(rest) <= set(r) for r in ran)


def test_head_node_tutorial_commands_are_ones_the_cluster_tests_run() -> None:
    ran = integration_commands()
    cluster = tutorial_commands(CLUSTER)
    assert any(w[0] in ("sbatch", "examples/submit.sh") for w in cluster)  # a job is submitted
    assert not [" ".join(w) for w in cluster if not run_by_the_cluster_tests(w, ran)]


def test_the_match_with_the_cluster_tests_can_fail() -> None:
    ran = integration_commands()
    for words in (["sinfo", "--long-gone-option"], ["scontrol", "reboot", "nodes"], ["sbatch", "examples/nope.sbatch"],
                  ["sbatch", "examples/ddp_container.sbatch"], ["sreport", "cluster"]):
        assert not run_by_the_cluster_tests(words, ran), words


def test_aws_tutorial_commands_are_exactly_the_readme_real_path() -> None:
    readme = {shlex.join(c) for title, text in shell_blocks(README) if title == AWS for c in commands(text)}
    tutorials = {shlex.join(c) for c in tutorial_commands(AWS)}
    assert readme and tutorials
    assert not readme - tutorials, "in the README's real path, not in a tutorial"
    assert not tutorials - readme, "in a tutorial, not in the README's real path"
