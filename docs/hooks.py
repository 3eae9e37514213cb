"""mkdocs hook: the command reference (pages/cli.md) written from the CLI's own argument parser at build time, so that
it lists exactly the commands and options `canvas-ls` has."""

from __future__ import annotations

import argparse
from typing import Any

MARKER = "<!-- the command reference is written here at build time (docs/hooks.py) -->"


def reference(parser: argparse.ArgumentParser, name: str = "canvas-ls", depth: int = 2) -> list[str]:
    """A section per command (subcommands nested): its usage, then a table of its options and arguments."""
    lines = [f"{'#' * depth} `{name}`", ""]
    if parser.description:
        lines += [parser.description.strip(), ""]
    lines += ["```", parser.format_usage().removeprefix("usage: ").strip(), "```", ""]
    rows, children = [], []
    for action in parser._actions:  # argparse has no public list of a parser's actions
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            children += [(command, sub, helps.get(command)) for command, sub in action.choices.items()]
        elif not isinstance(action, argparse._HelpAction):
            flags = ", ".join(f"`{flag}`" for flag in action.option_strings) or f"`{action.dest}`"
            text = (action.help or "").replace("|", "\\|").replace("\n", " ")
            if action.choices:
                text += f" (one of: {', '.join(str(c) for c in action.choices)})"
            rows.append(f"| {flags} | {text} |")
    if rows:
        lines += ["| option | meaning |", "|---|---|", *rows, ""]
    for command, sub, help_text in children:
        if help_text and not sub.description:
            sub.description = help_text
        lines += reference(sub, f"{name} {command}", min(depth + 1, 4))
    return lines


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    from canvas_ls.server.cli import parser

    return markdown.replace(MARKER, "\n".join(reference(parser())))
