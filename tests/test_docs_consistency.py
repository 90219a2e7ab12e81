"""The README and docs/ against the code they describe: every LRMoE flag, config field, default,
environment variable and benchmark option they name exists, so a renamed or dropped one fails
here instead of misleading a reader."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from megatron_lrmoe.config import LRMoEConfig
from megatron_lrmoe.training.args import (
    LRMOE_FLAGS,
    LRMOE_HELP_FLAG,
    LRMOE_KERNEL_FLAGS,
    LRMOE_TRACE_FLAG,
)

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPTS = [*sorted((ROOT / "examples").rglob("*.sh")), *sorted((ROOT / "benchmarks").glob("*.sh"))]
CODE_DIRS = ("megatron_lrmoe", "benchmarks", "scripts", "tests", "examples", ".ci")
# Scripts the docs name on purpose though they are not in the tree (the measurement's branch).
NOT_IN_TREE = {
    "benchmarks/wgrad_gather_bench.py": "docs/history/notebook.md section 17: branch only"
}
SCRIPT = re.compile(r"(benchmarks|scripts|examples/\w+)/(\w+)\.py")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`]*)`", text, flags=re.S)


def test_every_lrmoe_flag_named_in_docs_and_scripts_exists() -> None:
    flags = [*LRMOE_FLAGS.values(), *LRMOE_KERNEL_FLAGS.values()]
    known = {*flags, LRMOE_HELP_FLAG, LRMOE_TRACE_FLAG, "--lrmoe"}
    known |= {"--no-" + f[2:] for f in flags}  # BooleanOptionalAction's negation
    unknown = {
        (path.relative_to(ROOT).as_posix(), flag)
        for path in [*DOCS, *SCRIPTS]
        for flag in re.findall(r"(?<![\w-])(--(?:no-)?lrmoe(?:-[a-z0-9]+)*)(?![\w-])", _text(path))
        if flag not in known
    }
    assert not unknown, f"flags named in docs or scripts that pretrain_lrmoe.py lacks: {unknown}"


def _config_table() -> dict[str, str]:
    """``field -> default`` as docs/config.md's ``LRMoEConfig`` table writes them."""
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", _text(ROOT / "docs" / "config.md"), re.M)
    return {name: default.strip().strip("`") for name, default in rows}


def _as_written(value: object) -> str:
    if dataclasses.is_dataclass(value) and value == type(value)():
        return f"{type(value).__name__}()"  # an options object at its own defaults
    return f'"{value}"' if isinstance(value, str) else str(value)


def test_config_md_lists_every_field_with_its_default() -> None:
    table = _config_table()
    fields = {f.name: _as_written(f.default) for f in dataclasses.fields(LRMoEConfig)}
    assert set(table) >= set(fields), f"docs/config.md misses fields {set(fields) - set(table)}"
    wrong = {name: (table[name], fields[name]) for name in fields if table[name] != fields[name]}
    assert not wrong, f"docs/config.md defaults (written, actual) differ: {wrong}"


def test_every_environment_variable_named_in_docs_is_read_somewhere() -> None:
    named = {v for path in DOCS for v in re.findall(r"\bLRMOE_[A-Z0-9_]+\b", _text(path))}
    sources = [
        p for d in CODE_DIRS for p in (ROOT / d).rglob("*")
        if p.suffix in (".py", ".sh", "") and p.is_file() and "results" not in p.parts
    ]  # fmt: skip
    sources.append(ROOT / "pretrain_lrmoe.py")
    code = "\n".join(_text(p) for p in sources if p.stat().st_size < 2_000_000)
    unread = {v for v in named if not re.search(rf"\b{v}\b", code)}
    assert not unread, f"environment variables named in docs that no code reads: {unread}"


def _script_options(span: str) -> list[tuple[str, list[str]]]:
    """``(script path, --options after it)`` for each ``benchmarks/x.py``-style command in a
    code span, each command's options up to the next script, ``&&``, ``;`` or ``|``."""
    found = []
    for m in SCRIPT.finditer(span):
        rest = span[m.end():]
        stop = re.search(rf"{SCRIPT.pattern}|&&|;|\|", rest)
        rest = rest[: stop.start()] if stop else rest
        found.append((m.group(0), re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest)))
    return found


def test_script_options_in_docs_exist() -> None:
    problems = set()
    for path in DOCS:
        for span in _code_spans(_text(path)):
            for script, options in _script_options(span):
                if script in NOT_IN_TREE:
                    continue
                source = ROOT / script
                if not source.is_file():
                    problems.add((path.name, script, "no such script"))
                    continue
                code = _text(source)
                problems |= {
                    (path.name, script, option) for option in options
                    if f'"{option}"' not in code and f"'{option}'" not in code
                }  # fmt: skip
    assert not problems, f"commands in docs with scripts or options the tree lacks: {problems}"


@pytest.mark.parametrize(
    "span, expected",
    [
        ("python benchmarks/a.py --x 1 --y-z && benchmarks/b.py --w", [
            ("benchmarks/a.py", ["--x", "--y-z"]), ("benchmarks/b.py", ["--w"])]),
        ("torchrun --nproc_per_node=1 benchmarks/a.py --keep 1.0 | tee log --no", [
            ("benchmarks/a.py", ["--keep"])]),
    ],
)  # fmt: skip
def test_script_options_parser(span: str, expected: list) -> None:
    assert _script_options(span) == expected
