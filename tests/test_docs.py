"""The documentation: README.md short and for users, the site under docs/ builds strictly (broken links and pages
missing from the navigation fail), and what the docs say of the command line is what the command line has."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from canvas_ls.server import cli
from tests.conftest import REPO
from tests.test_cli import cli as run_cli

DOCS = [REPO / "README.md", REPO / "ARCHITECTURE.md", *sorted((REPO / "docs" / "pages").glob("*.md"))]


def commands() -> dict[str, argparse.ArgumentParser]:
    """Every command as it is typed ("complete", "bench soak") and its parser."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, prefix: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found[f"{prefix}{name}"] = sub
                    walk(sub, f"{prefix}{name} ")

    walk(cli.parser(), "")
    return found


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def mentions() -> list[tuple[str, str, list[str]]]:
    """(file, command, options) for each `canvas-ls ...` written in the docs: in inline code and in code blocks, a
    command line running to the end of its span (continuation lines of a usage block included)."""
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        spans = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S) + re.findall(r"`([^`\n]+)`", text)
        for span in spans:
            for line in re.split(r"\n(?!\s)|&&|\|\|", span):
                at = line.find("canvas-ls ")
                if at < 0:
                    continue
                words = line[at:].split()
                if len(words) < 2 or not re.fullmatch(r"[a-z][a-z-]*", words[1]):
                    continue
                command = words[1]
                if command in ("bench", "team") and len(words) > 2 and re.fullmatch(r"[a-z]+", words[2]):
                    command = f"{command} {words[2]}"
                flags = re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line[at:])
                found.append((path.name, command, flags))
    return found


def test_readme_is_short_and_for_users() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, len(lines)
    headings = [line for line in lines if line.startswith("## ")]
    assert "## The two commands" in headings and "## In your editor" in headings


def readme_command(heading: str) -> str:
    """The command of the README's "The two commands" that follows `heading` ("Main job", "Test suite")."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return text.split(f"\n{heading}", 1)[1].split("```sh\n", 1)[1].split("\n```", 1)[0]


def test_ci_runs_exactly_the_readme_s_test_command() -> None:
    """`.ci/run` (what CI runs on a clean clone) is the README's test command, word for word."""
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()
    assert ci[-1] == readme_command("Test suite")


def test_the_readme_s_main_job_completes_with_the_shipped_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's main job, its completion exactly as written (the set-up before it is what this suite runs in):
    the shipped model answers at the demo file's `return` what the docs quote (models.md), the line of `is_even`
    copied into `add`. A position past the line's end is refused (exit 2): the command names the end of the line as
    the file has it."""
    words = shlex.split(readme_command("Main job").split("&& ")[-1])
    assert words[:2] == ["canvas-ls", "complete"], words
    monkeypatch.chdir(REPO)
    done = run_cli(*words[1:])
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert (answer["text"], answer["stop_reason"], answer["healed"]) == (" n % 2 == 0\n", "eos", " return")


def test_every_command_and_option_the_docs_name_exists() -> None:
    known = commands()
    wrong = []
    for name, command, flags in mentions():
        if command not in known and command.split()[0] not in known:
            wrong.append(f"{name}: no command `canvas-ls {command}`")
            continue
        parser = known.get(command, known[command.split()[0]])
        wrong += [f"{name}: `canvas-ls {command}` has no {flag}" for flag in flags if flag not in options(parser)]
    assert not wrong, "\n".join(wrong)


def test_every_command_is_documented_by_hand_and_every_option_in_the_reference() -> None:
    sys.path.insert(0, str(REPO / "docs"))
    try:
        from hooks import reference
    finally:
        sys.path.remove(str(REPO / "docs"))
    written = {command for _, command, _ in mentions()}
    missing = [command for command in commands() if command not in written and command != "bench"]
    assert not missing, f"commands no page shows in use: {missing}"
    generated = "\n".join(reference(cli.parser()))
    for command, parser in commands().items():
        assert f"`canvas-ls {command}`" in generated
        assert all(f"`{flag}`" in generated for flag in options(parser) if flag not in ("-h", "--help"))


@pytest.mark.skipif(subprocess.run([sys.executable, "-m", "mkdocs", "--version"], capture_output=True).returncode,
                    reason="mkdocs is not installed (pip install -e '.[docs]')")  # fmt: skip
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "docs" / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    reference = (tmp_path / "site" / "cli" / "index.html").read_text(encoding="utf-8")
    assert "canvas-ls bench soak" in reference and "--fault" in reference
    assert "Reliability" in (tmp_path / "site" / "reliability" / "index.html").read_text(encoding="utf-8")


def test_the_code_map_names_every_module_and_only_modules_that_exist() -> None:
    """ARCHITECTURE.md's code map: each package's section names each of its modules, and no module it does not have."""
    text = (REPO / "ARCHITECTURE.md").read_text(encoding="utf-8")
    for package in ("engine", "server", "bench"):
        section = text.split(f"### `{package}/`", 1)[1].split("\n### ", 1)[0]
        named = set(re.findall(r"`(\w+)\.py`", section))
        modules = {p.stem for p in (REPO / package).glob("*.py")} - {"__init__"}
        assert modules - named == set(), f"{package}/: modules the code map does not name"
        assert named - modules == set(), f"{package}/: the code map names modules that do not exist"


def test_the_readme_s_links_lead_somewhere() -> None:
    """The README is read on the repository's page, where mkdocs checks nothing: its relative links must exist."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    links = [link for link in re.findall(r"\]\(([^)#]+)", text) if "://" not in link]
    assert links and [link for link in links if not (REPO / link).exists()] == []
