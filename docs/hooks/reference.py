"""mkdocs hook: generated reference pages and the committed figures.

* `<!-- generated: cli -->` in a page becomes the CLI reference, walked from the argparse
  parsers the commands themselves build (`python -m sim`, `python -m realexec`, ...), so
  it cannot drift from `--help`.
* `<!-- generated: config -->` becomes the configuration reference: every field of the
  config dataclasses (type, default, flag, help).
* `plots/figures/*.png` are served as `figures/*.png`, so pages show the committed figures
  without copies in docs/.

A command that fails to import or to build its parser fails the build (mkdocs --strict
turns the logged error into a failure), which is the point: the docs track the code.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import inspect
import io
import logging
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("mkdocs.hooks.reference")

# (title, module whose main(argv) builds and parses the parser, argv prefix)
SINGLE_CLIS = [
    ("python -m traces", "traces.cli", []),
    ("python -m sim.bench", "sim.bench", []),
    ("python -m sim.twin.tables", "sim.twin.tables", []),
    ("python -m sim.twin.spread", "sim.twin.spread", []),
    ("python -m core.bench", "core.bench", []),
    ("python -m realexec.bench.gpu", "realexec.bench.gpu", []),
    ("python -m plots", "plots.__main__", []),
    ("python -m plots.pipeline", "plots.pipeline", []),
]
CONFIG_CLASSES = [
    ("core.config", "CacheConfig"),
    ("core.config", "SchedulerConfig"),
    ("sim.config", "SimConfig"),
    ("realexec.config", "EngineArgs"),
    ("realexec.server.config", "ServerConfig"),
]


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def capture_parser(module: str, argv: list[str]) -> argparse.ArgumentParser:
    """The parser `module.main(argv)` builds: parse_args is intercepted before it runs."""
    def grab(self, *args, **kwargs):
        raise _Captured(self)

    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_args = grab
    argparse.ArgumentParser.parse_known_args = grab
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            importlib.import_module(module).main(list(argv))
    except _Captured as c:
        return c.parser
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved
    raise RuntimeError(f"{module}.main({argv}) returned without parsing arguments")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _code(text: str) -> str:
    """Text for a `code span` inside a table cell: only the column separator is escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(action: argparse.Action) -> str:
    d = action.default
    if d is None or d is argparse.SUPPRESS or d is False or isinstance(action, argparse._HelpAction):
        return ""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return ""
    return f"`{_code(d)}`"


def render_parser(parser: argparse.ArgumentParser, level: int, title: str | None = None,
                  leaf_only: bool = False) -> str:
    out = []
    subs = _subparsers(parser)
    if not (leaf_only and subs):
        out.append(f"{'#' * level} `{title or parser.prog}`\n")
        if parser.description:
            out.append(_cell(parser.description) + "\n")
        usage = parser.format_usage().strip().removeprefix("usage: ")
        out.append(f"```text\n{usage}\n```\n")
        formatter = parser._get_formatter()
        for group in parser._action_groups:
            rows = []
            for a in group._group_actions:
                if a.help == argparse.SUPPRESS or isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                    continue
                name = ", ".join(f"`{s}`" for s in a.option_strings) or f"`{a.dest}`"
                if a.option_strings and a.nargs != 0 and a.metavar is not None:
                    name += f" `{_code(a.metavar if isinstance(a.metavar, str) else ' '.join(a.metavar))}`"
                if a.choices and not isinstance(a.choices, dict):
                    name += " (" + ", ".join(f"`{c}`" for c in a.choices) + ")"
                rows.append(f"| {name} | {_default(a)} | {_cell(formatter._expand_help(a) if a.help else '')} |")
            if rows:
                out.append(f"*{group.title}*\n\n| argument | default | help |\n|---|---|---|\n" + "\n".join(rows) + "\n")
    for sub in subs.values():
        out.append(render_parser(sub, level + (0 if leaf_only and subs else 1)))
    return "\n".join(out)


def _realexec_leaves(table: dict, prefix: list[str]) -> list[list[str]]:
    leaves = []
    for name, entry in table.items():
        leaves += _realexec_leaves(entry, prefix + [name]) if isinstance(entry, dict) else [prefix + [name]]
    return leaves


def cli_reference() -> str:
    parts = ["## `python -m sim`\n", render_parser(capture_parser("sim.cli", []), 3, leaf_only=True)]
    commands = importlib.import_module("realexec.cli").COMMANDS
    parts.append("## `python -m realexec`\n")
    for path in _realexec_leaves(commands, []):
        parser = capture_parser("realexec.cli", path)
        for name in path:
            parser = _subparsers(parser)[name]
        parts.append(render_parser(parser, 3))
    parts.append("## Other entry points\n")
    for title, module, argv in SINGLE_CLIS:
        parts.append(render_parser(capture_parser(module, argv), 3, title=title))
    return "\n".join(parts)


def _field_comments(cls: type) -> dict[str, str]:
    """Trailing `# ...` comments on a dataclass's field lines (core's configs document fields so)."""
    lines, start = inspect.getsourcelines(cls)
    comments = {}
    for node in ast.parse("".join(lines).lstrip() if lines[0].startswith(" ") else "".join(lines)).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            line = lines[node.lineno - 1]
            if "#" in line:
                comments[node.target.id] = line.split("#", 1)[1].strip()
    return comments


def config_reference() -> str:
    out = []
    for module, name in CONFIG_CLASSES:
        cls = getattr(importlib.import_module(module), name)
        comments = _field_comments(cls)
        doc = inspect.getdoc(cls) or ""
        out.append(f"## `{module}.{name}`\n")
        if doc and not doc.startswith(f"{name}("):
            out.append(_cell(doc.split("\n\n")[0]) + "\n")
        out.append("| field | type | default | flag | help |\n|---|---|---|---|---|")
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            meta = f.metadata
            default = f.default if f.default is not dataclasses.MISSING else (
                "(computed)" if f.default_factory is not dataclasses.MISSING else "(required)")
            flag = meta.get("flag") or ("" if module.startswith("core.") else "--" + f.name.replace("_", "-"))
            help_ = meta.get("help") or comments.get(f.name, "")
            type_ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            out.append(f"| `{f.name}` | `{_code(type_)}` | `{_code(default)}` | {f'`{flag}`' if flag else ''} | "
                       f"{_cell(help_)} |")
        out.append("")
    return "\n".join(out)


# -- mkdocs events ------------------------------------------------------------------------
def on_config(config):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return config


def on_files(files, config):
    for png in sorted((ROOT / "plots" / "figures").glob("*.png")):
        files.append(File(f"figures/{png.name}", str(png.parent.parent), config["site_dir"],
                          config["use_directory_urls"]))
    return files


GENERATORS = {"<!-- generated: cli -->": cli_reference, "<!-- generated: config -->": config_reference}


def on_page_markdown(markdown, page, config, files):
    for marker, generate in GENERATORS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, generate())
    return markdown
