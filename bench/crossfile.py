"""`canvas-ls bench crossfile`: does the context block (`server/crossfile.py`) bring the code the cursor needs?

Tasks come from real repositories (Python files under each `--repo`): a line that uses a name (a call, a class)
defined at the top level of exactly one other file of the repository and not in its own file. The user has typed the
line up to and including that name; the rest of the line is the answer. The editor holds `open` files: the defining
one and others of the repository (seeded), never the task's own. Measured:

- recall: the share of tasks whose block holds the snippet that defines the name, at each budget (tokens);
  also with the cursor at the start of the line (the name not typed yet: only identifier overlap can find it);
- exact match of the rest of the line with and without the block (the default budget), with a model;
- prefix reuse while typing: the answer typed character by character, each keystroke a completion request through
  the engine's prefix cache; the share of prefix tokens not re-encoded, with the block and without it.
"""

from __future__ import annotations

import functools
import random
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine.tasks import edit_similarity, machine, normalise
from ..server.config import CompletionOptions
from ..server.context import Skip, build_context
from ..server.crossfile import CrossFile, display_path, snippets, words
from ..server.documents import Document
from .core import figure

TYPING = {"single_line": True, "gap_tokens": 16, "max_new_tokens": 48}


@dataclass(frozen=True)
class CrossTask:
    repo: str
    path: str  # the task's file, relative to its repository
    line: int
    name: str  # the name defined in another file
    defined_in: str
    prefix_text: str  # the file up to the cursor (the line typed up to and including the name)
    rest: str  # the rest of the line: the answer
    after: str  # the file after the line
    open_files: tuple[str, ...]  # paths relative to the repository, the defining file among them


def _document(repo: Path, path: str, text: str | None = None) -> Document:
    source = (repo / path).read_text(encoding="utf-8") if text is None else text
    return Document.open((repo / path).resolve().as_uri(), source, 1, "python")


def tasks(repos: list[Path], limit: int, open_count: int, seed: int = 0,
          only: set[str] | None = None) -> list[CrossTask]:  # fmt: skip
    """`only`: the task files allowed (paths relative to their repository), e.g. a training run's held-out ones."""
    found: list[CrossTask] = []
    for repo in repos:
        files = sorted(str(p.relative_to(repo)) for p in repo.rglob("*.py") if p.stat().st_size < 300_000)
        documents = {path: _document(repo, path) for path in files}
        defined: dict[str, set[str]] = {}
        for path, document in documents.items():
            for snippet in snippets(document, path):
                for name in snippet.defines:
                    defined.setdefault(name, set()).add(path)
        rng = random.Random(seed)
        for path, document in documents.items():
            if only is not None and path not in only:
                continue
            own = {name for name, paths in defined.items() if path in paths}
            start = 0
            for number, line in enumerate(document.text.split("\n")):
                code = line.strip()
                if len(code) >= 6 and not code.startswith(("#", "import ", "from ", "def ", "class ", "@")):
                    for name in sorted(words(code), key=code.find):
                        homes = defined.get(name, set())
                        if len(homes) != 1 or name in own or path in homes:
                            continue
                        (home,) = homes
                        at = re.search(rf"\b{name}\b", line).end()
                        others = [f for f in files if f not in (path, home)]
                        chosen = (home, *rng.sample(others, min(open_count - 1, len(others))))
                        found.append(CrossTask(repo.name, path, number, name, home,
                                               document.text[: start + at], line[at:],
                                               document.text[start + len(line):], chosen))  # fmt: skip
                        break
                start += len(line) + 1
    rng = random.Random(seed)
    rng.shuffle(found)
    return found[:limit]


@functools.lru_cache(maxsize=512)
def _source(repo: Path, path: str) -> Document:
    """An open file as it is on disk, parsed once for every task and budget (the block only reads it)."""
    return _document(repo, path)


def _block(task: CrossTask, repo: Path, text: str, offset: int, budget: int, cross: CrossFile | None = None) -> Any:
    current = _document(repo, task.path, text)
    sources = [_source(repo, path) for path in task.open_files]
    return (cross or CrossFile()).block(current, offset, sources, budget), current


def recall(task: CrossTask, repo: Path, budget: int, at_line_start: bool = False) -> bool:
    text = task.prefix_text + task.rest + task.after
    offset = len(task.prefix_text)
    if at_line_start:  # the line not typed yet: the cursor after its indentation, the line empty
        line_start = task.prefix_text.rfind("\n") + 1
        indent = len(task.prefix_text[line_start:]) - len(task.prefix_text[line_start:].lstrip())
        text = task.prefix_text[: line_start + indent] + task.after
        offset = line_start + indent
    block, _ = _block(task, repo, text, offset, budget)
    home = display_path((repo / task.defined_in).resolve().as_uri(), (repo / task.path).resolve().as_uri())
    return block is not None and any(s.path == home and task.name in s.defines for s in block.snippets)


def run_crossfile(repos: list[Path], limit: int, budgets: tuple[int, ...], open_count: int, engine: Any | None,
                  exact_limit: int, typing_tasks: int, budget: int,
                  only: set[str] | None = None) -> dict[str, Any]:  # fmt: skip
    by_name = {repo.name: repo for repo in repos}
    found = tasks(repos, limit, open_count, only=only)
    report: dict[str, Any] = {"repos": [str(r) for r in repos], "tasks": len(found), "open_files": open_count,
                              "task_files": "all" if only is None else sorted(only),
                              "machine": machine(), "recall": {}, "recall_line_start": {}}  # fmt: skip
    for size in budgets:
        report["recall"][str(size)] = statistics.fmean(recall(t, by_name[t.repo], size) for t in found)
        report["recall_line_start"][str(size)] = statistics.fmean(
            recall(t, by_name[t.repo], size, at_line_start=True) for t in found
        )
    if engine is None:
        return report
    report["model"], report["dtype"], report["budget"] = engine.name, engine.dtype, budget
    options = CompletionOptions()
    rows = []
    for task in found[:exact_limit]:
        repo = by_name[task.repo]
        text = task.prefix_text + task.after
        offset = len(task.prefix_text)
        block, document = _block(task, repo, text, offset, budget)
        context = build_context(document, offset, options)
        if isinstance(context, Skip):
            continue
        row = {"task": f"{task.repo}/{task.path}:{task.line + 1}", "name": task.name, "rest": task.rest}
        for mode, lead in (("without", ""), ("with", block.text if block else "")):
            overrides = {**TYPING, "max_prefix_tokens": options.prefix_tokens + budget}
            answer = engine.infill(lead + context.prefix, context.suffix, overrides).text.split("\n", 1)[0]
            row[mode] = {"text": answer, "exact": normalise(answer) == normalise(task.rest),
                         "edit_similarity": edit_similarity(answer, task.rest)}  # fmt: skip
        rows.append(row)
    for mode in ("without", "with"):
        report[f"exact_{mode}"] = statistics.fmean(r[mode]["exact"] for r in rows) if rows else None
        report[f"edit_similarity_{mode}"] = statistics.fmean(r[mode]["edit_similarity"] for r in rows) if rows else None
    report["exact_tasks"] = len(rows)
    report["rows"] = rows
    report["typing"] = _typing_reuse(found[:typing_tasks], by_name, engine, options, budget)
    return report


def _typing_reuse(found: list[CrossTask], by_name: dict[str, Path], engine: Any, options: CompletionOptions,
                  budget: int) -> dict[str, Any]:  # fmt: skip
    """Type each answer character by character; per keystroke, the share of the prefix the engine reused."""
    result: dict[str, Any] = {}
    for mode, size in (("without", 0), ("with", budget)):
        reused = total = keystrokes = 0
        cross = CrossFile()
        started = time.perf_counter()
        for task in found:
            repo = by_name[task.repo]
            for typed in range(len(task.rest) + 1):
                text = task.prefix_text + task.rest[:typed] + task.after
                offset = len(task.prefix_text) + typed
                block, document = _block(task, repo, text, offset, size, cross) if size else (None, None)
                document = document or _document(repo, task.path, text)
                context = build_context(document, offset, options)
                if isinstance(context, Skip):
                    continue
                lead = block.text if block else ""
                overrides = {**TYPING, "max_prefix_tokens": options.prefix_tokens + budget}
                out = engine.infill(lead + context.prefix, context.suffix, overrides)
                reused += out.prefix_reused_tokens
                total += out.prefix_tokens
                keystrokes += 1
        result[mode] = {"keystrokes": keystrokes, "reuse_ratio": reused / max(total, 1),
                        "blocks_built": cross.built, "blocks_reused": cross.reused,
                        "seconds": time.perf_counter() - started}  # fmt: skip
    return result


def format_crossfile(report: dict[str, Any]) -> str:
    lines = [f"{report['tasks']} tasks from {', '.join(report['repos'])}; {report['open_files']} files open",
             report["machine"], "", f"{'budget (tokens)':<18}{'recall':>8}{'(line start)':>14}"]  # fmt: skip
    for size, value in report["recall"].items():
        lines.append(f"{size:<18}{100 * value:>8.1f}{100 * report['recall_line_start'][size]:>14.1f}")
    if "exact_with" in report:
        lines += [
            "",
            f"model {report['model']} ({report['dtype']}), {report['exact_tasks']} tasks, budget "
            f"{report['budget']}: exact {100 * report['exact_without']:.1f}% without the block, "
            f"{100 * report['exact_with']:.1f}% with; edit similarity "
            f"{100 * report['edit_similarity_without']:.1f} vs {100 * report['edit_similarity_with']:.1f}%",
        ]
        for mode, row in report["typing"].items():
            if not row["keystrokes"]:
                continue
            lines.append(f"typing {mode} the block: {row['keystrokes']} keystrokes, prefix reused "
                         f"{100 * row['reuse_ratio']:.1f}% (blocks built {row['blocks_built']}, reused "
                         f"{row['blocks_reused']}), {row['seconds']:.1f} s")  # fmt: skip
    return "\n".join(lines)


def plot_crossfile(report: dict[str, Any], path: Path) -> Path:
    sizes = [int(s) for s in report["recall"]]
    with figure(path, (5.6, 3.6)) as (_, axis):
        _draw_recall(report, sizes, axis)
    return path


def _draw_recall(report: dict[str, Any], sizes: list[int], axis: Any) -> None:
    axis.plot(sizes, [100 * report["recall"][str(s)] for s in sizes], "o-", label="the name typed")
    axis.plot(sizes, [100 * report["recall_line_start"][str(s)] for s in sizes], "s--", label="at the line start")
    axis.axhline(80, color="grey", linewidth=0.8, linestyle=":")
    axis.set_xlabel("context block budget (tokens)")
    axis.set_ylabel("defining snippet in the block (%)")
    axis.set_ylim(0, 100)
    axis.set_xticks(sizes)
    axis.set_title(f"cross-file retrieval recall, {report['tasks']} tasks", fontsize=10)
