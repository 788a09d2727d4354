"""The docs' reference pages that are generated, so that they cannot drift from the code: the stack file's keys from
the pydantic model (gpucluster/spec/model.py) and the command line's help. tests/test_docs.py compares the committed
pages with what this module produces; `GPUCLUSTER_UPDATE_GOLDEN=1` rewrites them, as for the other golden files.

A key's description is its `Field(description=...)` or else the comment block right above the field in model.py: the
model's comments are its documentation, so a field without either is an error here."""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
import textwrap
import types
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from gpucluster.spec import catalog, eks, model

ROOT = Path(__file__).resolve().parent.parent
STACK_FILE_PAGE = ROOT / "docs" / "reference" / "stack-file.md"
CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"
VERIFY_PAGE = ROOT / "docs" / "reference" / "verify.md"
REGENERATE = "GPUCLUSTER_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_docs.py"

# Keys whose allowed values a validator checks against a table of the library: the same tables, listed.
ALLOWED_FROM_TABLES: dict[str, tuple[str, list[str]]] = {
    model.REGION_KEY: ("catalog.AWS_REGIONS", sorted(catalog.AWS_REGIONS)),
    "head_node.instance_type": ("catalog.HEAD_NODE", list(catalog.HEAD_NODE)),
    "kubernetes.cpu_nodes.instance_type": ("catalog.HEAD_NODE", list(catalog.HEAD_NODE)),
    "pools[].instance_type": ("catalog.ACCELERATED", list(catalog.ACCELERATED)),
    "kubernetes.version": ("eks.VERSIONS", list(eks.VERSIONS)),
}


@dataclass(frozen=True)
class Key:
    path: str  # under gpucluster:cluster, e.g. "pools[].min_nodes"
    kind: str  # the YAML type, in words
    default: str
    allowed: str
    description: str
    section: str | None  # a mapping's (or a list of mappings') keys are under this path: "storage.lustre", "pools[]"


def field_comments(cls: type[BaseModel]) -> dict[str, str]:
    """Field name -> the comment block right above its line in the class body."""
    lines = textwrap.dedent(inspect.getsource(cls)).splitlines()
    body = ast.parse("\n".join(lines)).body[0]
    assert isinstance(body, ast.ClassDef)
    comments: dict[str, str] = {}
    for node in body.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            above: list[str] = []
            row = node.lineno - 2  # the line above the field, 0-based
            while row >= 0 and lines[row].lstrip().startswith("#"):
                above.insert(0, lines[row].lstrip()[1:].strip())
                row -= 1
            if above:
                comments[node.target.id] = " ".join(above)
    return comments


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """The annotation without `| None`, and whether null is allowed."""
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [a for a in get_args(annotation) if a is not type(None)]
        return (rest[0] if len(rest) == 1 else Union[tuple(rest)]), len(rest) < len(get_args(annotation))
    return annotation, False


def _model_of(annotation: Any) -> type[BaseModel] | None:
    inner, _ = _unwrap(annotation)
    if get_origin(inner) is list:
        inner = get_args(inner)[0]
    return inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None


def _type_name(annotation: Any) -> str:
    inner, nullable = _unwrap(annotation)
    if get_origin(inner) is Annotated:
        inner = get_args(inner)[0]
    if get_origin(inner) is list:
        name = f"list of {_type_name(get_args(inner)[0])}s"
    elif get_origin(inner) is dict:
        name = f"mapping of {_type_name(get_args(inner)[0])}s to {_type_name(get_args(inner)[1])}s"
    elif get_origin(inner) is Literal:
        name = "string"
    elif isinstance(inner, type) and issubclass(inner, BaseModel):
        name = "mapping"
    else:
        name = {str: "string", int: "integer", float: "number", bool: "boolean"}[inner]
    return f"{name} or null" if nullable else name


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, BaseModel):  # a section whose keys all have defaults, or a default naming its required keys
        required = [name for name, field in type(value).model_fields.items() if field.is_required()]
        return _yaml({name: getattr(value, name) for name in required}) if required else "every key's default"
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _constraints(name: str, annotation: Any, metadata: list[Any]) -> list[str]:
    """What the field's type and metadata allow, in words (a list's item constraints included)."""
    out: list[str] = []
    inner, _ = _unwrap(annotation)
    if get_origin(inner) is Literal:
        out.append("one of " + ", ".join(f"`{v}`" for v in get_args(inner)))
    if get_origin(inner) is list and get_origin(item := get_args(inner)[0]) is Annotated:
        out += [f"each: {c}" for meta in get_args(item)[1:] if isinstance(meta, FieldInfo)
                for c in _constraints(name, str, meta.metadata)]
    unit = "item" if get_origin(inner) is list else "character"
    low = next((m.ge for m in metadata if isinstance(m, annotated_types.Ge)), None)
    high = next((m.le for m in metadata if isinstance(m, annotated_types.Le)), None)
    if low is not None and high is not None:
        out.append(f"{low} to {high}")
    else:
        out += [f">= {low}"] * (low is not None) + [f"<= {high}"] * (high is not None)
    out += [f"> {m.gt}" for m in metadata if isinstance(m, annotated_types.Gt)]
    out += [f"at least {m.min_length} {unit}{'s' * (m.min_length != 1)}" for m in metadata
            if isinstance(m, annotated_types.MinLen)]
    out += [f"at most {m.max_length} {unit}{'s' * (m.max_length != 1)}" for m in metadata
            if isinstance(m, annotated_types.MaxLen)]
    patterns = [p for meta in metadata if (p := getattr(meta, "pattern", None))]
    # What a pattern allows in the words the checker's own messages use, else the pattern itself.
    return [model.PATTERN_HELP.get(name, f"matches `{p}`") for p in patterns] + out


def keys(cls: type[BaseModel] = model.ClusterSpec, prefix: str = "") -> Iterator[Key]:
    """Every key of the stack file's cluster mapping, depth first, each section after its own key."""
    comments = field_comments(cls)
    for name, field in cls.model_fields.items():
        path = f"{prefix}{name}"
        description = field.description or comments.get(name)
        if not description:
            raise ValueError(f"{cls.__name__}.{name} ({path}) has no description: add a comment above it in "
                             "gpucluster/spec/model.py")
        model_ = _model_of(field.annotation)
        section = None if model_ is None else path + ("[]" if get_origin(_unwrap(field.annotation)[0]) is list else "")
        allowed = _constraints(name, field.annotation, field.metadata)
        if path in ALLOWED_FROM_TABLES:
            table, values = ALLOWED_FROM_TABLES[path]
            allowed.append(f"one of {table}: " + ", ".join(f"`{v}`" for v in values))
        default = "required" if field.is_required() else _yaml(field.get_default(call_default_factory=True))
        yield Key(path, _type_name(field.annotation), default, "; ".join(allowed), description, section)
        if model_ is not None and section is not None:
            yield from keys(model_, f"{section}.")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(rows: list[Key]) -> list[str]:
    out = ["| key | type | default | allowed | description |", "| --- | --- | --- | --- | --- |"]
    for key in rows:
        leaf = key.path.rsplit(".", 1)[-1]
        name = f"[`{leaf}`](#{_anchor(key.section)})" if key.section else f"`{leaf}`"
        out.append(f"| {name} | {key.kind} | {_cell(key.default)} | {_cell(key.allowed)} | {_cell(key.description)} |")
    return out


def _anchor(path: str) -> str:
    """The id MkDocs gives the heading of a section (see _heading)."""
    return "".join(c for c in f"gpuclustercluster{path}".replace(".", "").replace("[]", "") if c.isalnum() or c in "-_")


def _heading(path: str) -> str:
    return f"## `gpucluster:cluster.{path}` {{#{_anchor(path)}}}"


def stack_file_page() -> str:
    """docs/reference/stack-file.md."""
    every = list(keys())
    under: dict[str, list[Key]] = defaultdict(list)
    for key in every:
        under[key.path.rpartition(".")[0]].append(key)
    lines = [
        "# Stack file keys",
        "",
        f"<!-- Generated by tests/docgen.py from gpucluster/spec/model.py. Do not edit: {REGENERATE} -->",
        "",
        "A stack file is `stacks/Pulumi.<stack>.yaml`; the stack's name is the file's (lowercase letters, digits and "
        f"`-`, at most {model.MAX_STACK_NAME} characters). Under `config:` it holds two keys: `{model.REGION_KEY}` and "
        f"`{model.CONFIG_KEY}`, the cluster mapping whose keys follow. A key not listed here is refused. "
        "`make plan STACK=<stack>` checks a file and names every problem at once, each with its path "
        "(see [Adding a team](../tutorials/adding-a-team.md)). The shipped stacks under `stacks/` are examples.",
        "",
        "## Top level",
        "",
        "| key | type | default | allowed | description |",
        "| --- | --- | --- | --- | --- |",
        f"| `{model.REGION_KEY}` | string | required | one of {ALLOWED_FROM_TABLES[model.REGION_KEY][0]} "
        f"({catalog.REGIONS_SOURCE}): " + ", ".join(f"`{r}`" for r in ALLOWED_FROM_TABLES[model.REGION_KEY][1])
        + " | The AWS region of every resource of the stack. |",
        f"| [`{model.CONFIG_KEY}`](#{_anchor('')}) | mapping | required |  | The cluster: the keys below. |",
        "",
        f"## `{model.CONFIG_KEY}` {{#{_anchor('')}}}",
        "",
        *_table(under[""]),
    ]
    for key in every:
        if key.section:
            lines += ["", _heading(key.section), "", key.description, "", *_table(under[key.section])]
    pool_types = ALLOWED_FROM_TABLES["pools[].instance_type"][0]
    lines += ["", "## Instance types", "",
              f"The types a pool may name (`{pool_types}` in gpucluster/spec/catalog.py), with the on-demand price the "
              f"plan uses ({catalog.PRICE_SOURCE}, recorded {catalog.PRICE_DATE}). `preflight` reads live prices.", "",
              "| type | accelerator | vCPUs | memory GiB | EFA interfaces | $/h on demand |",
              "| --- | --- | --- | --- | --- | --- |"]
    for t in catalog.ACCELERATED.values():
        acc = t.accelerator
        accelerator = f"{acc.count} x {acc.model} ({acc.kind}, {acc.memory_gib_each} GiB each)" if acc else ""
        price = f"{t.on_demand_usd_per_hour:.3f}" if t.on_demand_usd_per_hour is not None else "not published"
        efa = t.efa_interfaces or "no EFA"
        lines.append(f"| `{t.name}` | {accelerator} | {t.vcpus} | {t.memory_mib // 1024} | {efa} | {price} |")
    lines += ["", "The head node's types (`catalog.HEAD_NODE`):", "", "| type | vCPUs | memory GiB | $/h on demand |",
              "| --- | --- | --- | --- |"]
    lines += [f"| `{t.name}` | {t.vcpus} | {t.memory_mib // 1024} | {t.on_demand_usd_per_hour:.4f} |"
              for t in catalog.HEAD_NODE.values() if t.on_demand_usd_per_hour is not None]
    return "\n".join(lines) + "\n"


HELP_COLUMNS = "100"


def help_text(*args: str) -> str:
    """`gpucluster ARGS --help` (the same program as `python -m gpucluster`) as a user's terminal of 100 columns shows
    it: argparse's help, made in this process (a process per command costs seconds of CPU; test_docs runs the command
    once to prove it prints this)."""
    from unittest import mock

    from gpucluster.cli import parser
    from gpucluster.completion import commands as parser_commands

    top = parser()
    with mock.patch.dict(os.environ, {"COLUMNS": HELP_COLUMNS}):  # argparse wraps to the terminal's width
        return (parser_commands(top)[args[0]] if args else top).format_help()


def help_printed(*args: str) -> str:
    """What `python -m gpucluster ARGS --help` prints (the `gpucluster` command's program), run as a user runs it."""
    env = {**os.environ, "COLUMNS": HELP_COLUMNS}
    return subprocess.run([sys.executable, "-m", "gpucluster", *args, "--help"], cwd=ROOT, env=env, check=True,
                          capture_output=True, text=True).stdout


def cli_page() -> str:
    """docs/reference/cli.md."""
    from gpucluster.cli import parser
    from gpucluster.completion import commands as parser_commands

    commands = parser_commands(parser())
    lines = [
        "# Command line",
        "",
        f"<!-- Generated by tests/docgen.py from `gpucluster --help`. Do not edit: {REGENERATE} -->",
        "",
        "`pip install .` (or `make plan`, into `.venv`) installs the `gpucluster` command; `python -m gpucluster` is "
        "the same program. STACK is a path to a stack file, or a name looked up in `./stacks`, then in "
        "`$GPUCLUSTER_STACKS`, so it runs from any directory. On the head node the same program is the `gpucluster` "
        "command, with the stack's file in its bundle. Exit codes: 0 ok, 1 a check failed or something still bills, 2 "
        "bad input or usage (README, \"Exit codes\").",
        "",
        "## `gpucluster`",
        "",
        "```text",
        help_text().rstrip(),
        "```",
    ]
    for name in commands:
        lines += ["", f"## `{name}`", "", "```text", help_text(name).rstrip(), "```"]
    return "\n".join(lines) + "\n"


def check_descriptions() -> dict[str, str]:
    """Check name -> the comment beside its constant in gpucluster/contract/verify.py (`GPUS = "gpus"  # ...`): the
    contract's comments are the checks' documentation, so a check without one is an error here."""
    from gpucluster.contract import verify

    source = Path(inspect.getsourcefile(verify) or "").read_text()
    found = {m[1]: m[2].strip() for m in re.finditer(r'^[A-Z_]+ = "([a-z_]+)"  # (.+)$', source, re.MULTILINE)}
    missing = [name for name in verify.CHECK_NAMES if name not in found]
    if missing:
        raise ValueError(f"checks without a comment beside their constant in contract/verify.py: {missing}")
    return {name: found[name] for name in verify.CHECK_NAMES}


def verify_page() -> str:
    """docs/reference/verify.md: the checks (contract/verify.py) and the figures per instance type (the catalog)."""
    from gpucluster.contract import settings, verify
    from gpucluster.render import dashboards, verify as planning

    lines = [
        "# `gpucluster verify`: the checks and the figures",
        "",
        f"<!-- Generated by tests/docgen.py from gpucluster/contract/verify.py and the instance catalog. Do not edit: "
        f"{REGENERATE} -->",
        "",
        "`gpucluster verify STACK --plan` lists the checks a run makes on a stack's pools and the figure "
        "each must reach (`--json`: the plan as the head reads it). Each check is judged pass, fail (with the fix "
        "below), or warn where no figure is known: a check never passes on a figure it cannot compare. The cluster's "
        f"checks come once per run, under the pool name `{verify.CLUSTER}`.",
        "",
        "## The checks",
        "",
        "| check | expects | judged | fix when it fails |",
        "| --- | --- | --- | --- |",
    ]
    judged = {"equal": "equal to", "min": "at least", "max": "at most", "true": "true"}
    for name, what in check_descriptions().items():
        rule = verify.RULES[name]
        lines.append(f"| `{name}` | {_cell(what)} | {judged[rule.kind]}{f' `{rule.key}`' if rule.key else ''} "
                     f"| {_cell(rule.fix)} |")
    lines += [
        "",
        "## The figures per instance type",
        "",
        "From the instance catalog (gpucluster/spec/catalog.py). The all_reduce floor is "
        f"{round(catalog.ALL_REDUCE_FLOOR_FRACTION * 100)}% of the published bus bandwidth of two nodes, read at the "
        "published sweep's largest size (the plan's `bytes`: the run's all_reduce_perf sweeps to it, and a run that "
        "stopped short fails); a type without a published figure sweeps to "
        f"{verify.DEFAULT_ALL_REDUCE_BYTES // 2**30} GiB and warns. Scale from zero may take the type's provision "
        "time, never more than the stack's Slurm ResumeTimeout. /fsx's floors are "
        f"{round(planning.FSX_FLOOR_FRACTION * 100)}% of the file system's disk baseline, or of what the job's nodes' "
        "primary network cards carry if less.",
        "",
        "| instance type | GPUs / Neuron devices | EFA devices | all_reduce busbw floor | published at | "
        "primary network | scale from zero |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    sources: dict[str, int] = {}
    for itype in catalog.ACCELERATED.values():
        accelerator = itype.accelerator
        devices = f"{accelerator.count}{'' if accelerator.kind == 'nvidia' else ' (Neuron)'}" if accelerator else ""
        figure = itype.all_reduce
        if figure is None:
            floor, published = ("no figure: warns" if accelerator and accelerator.kind == "nvidia"
                                else "not run (no NCCL)"), ""
        else:
            note = sources.setdefault(figure.source, len(sources) + 1)
            floor = f"{figure.floor_gbps} GB/s"
            published = f"{figure.published_gbps} GB/s at {figure.message_bytes // 2**30} GiB [{note}]"
        lines.append(f"| `{itype.name}` | {devices} | {itype.efa_interfaces or 'none: no check'} | {floor} | "
                     f"{published} | {itype.primary_network_gbps:g} Gbps | {itype.provision_minutes} min |")
    lines += ["", "Sources:", ""] + [f"{n}. {_cell(source)}" for source, n in sources.items()]
    lines += [
        "",
        "## On the board",
        "",
        "The team's Grafana overview has a table **Verify: last result per pool**: one row per pool and check with the "
        "last run's result (" + ", ".join(f"{word} {colour}" for word, colour in dashboards.RESULT_COLOURS.items())
        + ") and when that pool's run ended. A run on the head "
        f"writes them into node_exporter's textfile collector ({settings.VERIFY_TEXTFILE}) as "
        f"`{verify.RESULT_METRIC}{{pool, check}}` (" + ", ".join(f"{code} {word}" for word, code in
                                                                  verify.RESULT_CODES.items()) +
        f") and `{verify.RUN_TIME_METRIC}{{pool}}` (Unix time); each run's whole JSON stays under "
        f"{settings.VERIFY_DIR}, and `gpucluster verify --last` prints the latest.",
        "",
        f"all_reduce_perf is nccl-tests' (built into NVIDIA images at {settings.ALL_REDUCE_PERF}, at the bill of "
        "materials' pinned commit: gpucluster/spec/bom.py).",
    ]
    return "\n".join(lines) + "\n"


PAGES = {STACK_FILE_PAGE: stack_file_page, CLI_PAGE: cli_page, VERIFY_PAGE: verify_page}
