"""A repository's commits as edits (engine/commits.py) and `bench edits`, which replays them through the server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from canvas_ls.bench.edits import cases, run_edits_bench
from canvas_ls.engine.commits import (
    MAX_FILE_BYTES,
    Hunk,
    differing,
    edit_texts,
    history,
    hunks,
    mine,
    recent_edits_comment,
    split,
)
from canvas_ls.engine.examples import ExampleSampler
from canvas_ls.engine.tokenizer import train_tokenizer
from tests.conftest import tokenizer_texts
from tests.test_adapters import cli

BEFORE = "def total(items):\n    count = 0\n    for item in items:\n        count += item\n    return count\n"
AFTER = "def total(items):\n    amount = 0\n    for item in items:\n        amount += item\n    return count\n"
PADDING = "".join(f"\ndef helper_{n}():\n    return {n}\n" for n in range(12))  # a quiet stretch below


def git(repo: Path, *args: str) -> None:
    env = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", *env, "-C", str(repo), *args], check=True, capture_output=True)


def commit(repo: Path, message: str, **files: str | bytes | None) -> None:
    for name, content in files.items():
        path = repo / name.replace("__", ".")
        if content is None:
            git(repo, "rm", "-q", path.name)
            continue
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        git(repo, "add", path.name)
    git(repo, "commit", "-q", "-m", message)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A history with one editable commit (2 hunks in calc.py) and one of each kind that cannot be an edit."""
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q")
    sources = {f"m{n}__py": text for n, text in enumerate(tokenizer_texts()[:6])}  # enough source to train on
    commit(root, "root", calc__py=BEFORE + PADDING, notes__txt="notes\n", **sources)
    commit(root, "binary and huge files", blob__py=b"\x00\x01", big__py="x = 1\n" * (MAX_FILE_BYTES // 6 + 1))
    commit(root, "edit the binary and huge files", blob__py=b"\x00\x02", big__py="x = 2\n" * (MAX_FILE_BYTES // 6 + 1))
    commit(root, "a text file", notes__txt="notes, more\n")
    git(root, "mv", "blob.py", "moved.py")
    commit(root, "a rename")
    git(root, "checkout", "-q", "-b", "side")
    commit(root, "on a branch", side__py="s = 1\n")
    git(root, "checkout", "-q", "main")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "merge", "-q", "--no-ff", "-m", "merge", "side")
    commit(root, "rename count to amount, twice", calc__py=AFTER + PADDING)
    return root


def test_a_history_is_mined_into_file_changes_and_what_is_no_edit_is_counted(repo: Path) -> None:
    commits = history(repo)
    assert len(commits) == 7 and [len(parents) for _, parents in commits] == [0, 1, 1, 1, 1, 2, 1]
    mined = mine(repo, commits)
    assert dict(mined.skipped) == {"root commit": 1, "added or deleted file": 2, "binary or huge file": 2,
                                   "not a source file of a known language": 1, "renamed or copied file": 1,
                                   "merge commit": 1}  # fmt: skip
    (change,) = mined.changes
    assert (change.path, change.language, len(change.hunks)) == ("calc.py", "python", 2)
    assert change.hunks[0] == Hunk(BEFORE.index("    count = 0"), BEFORE.index("    for"), "    amount = 0\n")
    assert change.applied(2)[0] == AFTER + PADDING
    text, placed = change.applied(1)
    assert text[placed[1].start : placed[1].end] == "        count += item\n"  # the next hunk, where it now stands


def test_the_newest_commits_are_held_out_and_one_is_always_left_to_train_on(repo: Path) -> None:
    commits = history(repo)
    assert split(commits, 2) == (commits[:5], commits[5:])
    assert split(commits, 100) == (commits[:1], commits[1:])
    assert split([], 3) == ([], [])


def test_a_folder_without_history_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a git repository"):
        history(tmp_path)
    git(tmp_path, "init", "-q")
    with pytest.raises(ValueError, match="has no commits"):
        history(tmp_path)
    done = subprocess.run([sys.executable, "-m", "canvas_ls.server.cli", "bench", "edits", "--repo", str(tmp_path)],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)  # fmt: skip
    assert done.returncode != 0 and "bench edits: " in done.stderr and "has no commits" in done.stderr


def test_hunks_are_line_runs_in_file_order_and_narrow_to_what_is_typed() -> None:
    assert hunks("a\nb\nc\n", "a\nB\nc\nd\n") == (Hunk(2, 4, "B\n"), Hunk(6, 6, "d\n"))
    assert hunks("same\n", "same\n") == ()
    assert Hunk(4, 18, "    amount = 0\n").narrowed("def\n    count = 0\n") == Hunk(8, 9, "am")


def test_differing_finds_the_changed_middle_of_long_texts_block_by_block() -> None:
    text = "".join(f"x{n:03} = {n:03}\n" for n in range(300))  # 3,300 characters: several blocks on each side
    assert differing(text, text[:1234] + "yy" + text[1234:]) == (1234, 1234, 1236)
    assert differing(text, text[:700] + text[1900:]) == (700, 1900, 700)
    assert differing(text, "z" + text[1:]) == (0, 1, 1) and differing(text, text[:-2] + "z\n") == (3298, 3299, 3299)
    assert differing(text, text) == (3300, 3300, 3300) and differing("", text) == (0, 0, 3300)


def test_the_recent_edits_read_the_same_everywhere() -> None:
    expected = "# recent edits, newest last:\n# 'count' -> 'amount'\n"
    assert recent_edits_comment("python", [("count", "amount")]) == expected
    assert recent_edits_comment("go", [("a", "b")]).startswith("// recent edits")
    assert recent_edits_comment("python", []) == ""


def test_the_cases_are_the_next_hunk_and_a_window_away_from_every_hunk(repo: Path) -> None:
    (change,) = mine(repo, history(repo)).changes
    (next_hunk, quiet) = cases([change], per_file=2, limit=10, window_lines=3)
    assert (next_hunk.applied, next_hunk.target.text if next_hunk.target else None) == (1, "        amount += item\n")
    # The edit as typed ("c" -> "am" of "count"): the cursor after it, in the word it renamed.
    assert next_hunk.cursor == BEFORE.index("count = 0") + len("am")
    text = change.applied(2)[0]
    assert quiet.target is None and text[quiet.cursor :] == "    return 11\n"  # the farthest line from both


def test_the_bench_replays_a_rename_and_repeat_finds_the_next_site(repo: Path, ending_model_dir: Path) -> None:
    report = run_edits_bench(repo, 1, str(ending_model_dir), "cpu", per_file=2, limit=10, options={})
    repeat = report["summary"]["repeat"]
    # After "count" -> "amount" on line 2, the next use of "count" below is the next hunk, exactly.
    assert (repeat["cases"], repeat["exact"], repeat["location"], repeat["shown"], repeat["precision"]) == (
        1, 1.0, 1.0, 1.0, 1.0)  # fmt: skip
    # The quiet window far below: the commit left "return count" as it was, and repeat suggests renaming it there.
    assert report["results"]["repeat"][1]["confidence"] == 0.85
    assert report["summary"]["default"]["exact"] == 1.0 and report["held_out_commits"] == 1


def test_the_history_becomes_rewrite_examples_and_no_ops(repo: Path, tmp_path: Path) -> None:
    texts = edit_texts(mine(repo, history(repo)).changes)
    first, second, quiet = texts
    assert (first.old, first.new, first.recent) == ("    count = 0\n", "    amount = 0\n", ())
    assert (second.old, second.new, second.recent) == ("        count += item\n", "        amount += item\n",
                                                       (("c", "am"),))  # fmt: skip
    assert second.prompt.startswith("# recent edits, newest last:\n# 'c' -> 'am'\ndef total(items):\n")
    assert quiet.old == quiet.new == "    return 11\n"  # a line far from both hunks, to leave alone
    tokenizer = train_tokenizer(tokenizer_texts(), 400, tmp_path)
    sampler = ExampleSampler([], tokenizer, 0, 64, 8, edits=[second], edit_share=1.0)
    example = sampler.example(gap_tokens=16)
    shown = tokenizer.decode([t for t in (example.start or []) if t != tokenizer.eos_token_id])
    assert (shown, tokenizer.decode(example.gap[: example.middle_len])) == (second.old, second.new)
    assert tokenizer.decode(example.prefix[1:]).endswith("    amount = 0\n    for item in items:\n")


def test_train_learns_next_edits_from_the_history_and_says_what_it_mined(repo: Path, tiny_model_dir: Path,
                                                                        tmp_path: Path) -> None:  # fmt: skip
    import json

    refused = cli("train", "--edits", "3", "--out", str(tmp_path / "x"))
    assert refused.returncode != 0 and "--edits HELD_OUT (>= 0) needs --corpus or --workspace" in refused.stderr
    out = tmp_path / "out"
    done = cli("train", "--from", str(tiny_model_dir), "--corpus", str(repo), "--edits", "0", "--edit-share", "0.5",
               "--lora", "4", "--minutes", "0.02", "--out", str(out), "--fp32")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    mined = json.loads((out / "repository_report.json").read_text())["edits"]
    assert (mined["commits"], mined["file_changes"], mined["examples"], mined["no_ops"]) == (7, 1, 3, 1)
    assert mined["tree_at"] is None  # nothing held out: the files as they are
    final = json.loads((out / "log.jsonl").read_text().splitlines()[-1])["final"]["config"]
    assert (final["edits_held_out"], final["edit_share"]) == (0, 0.5)
    # The newest commit held out: neither its hunks nor its result are trained on (the files as they were before it).
    held = tmp_path / "held"
    done = cli("train", "--from", str(tiny_model_dir), "--corpus", str(repo), "--edits", "1", "--lora", "4",
               "--minutes", "0.01", "--out", str(held), "--fp32")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    mined = json.loads((held / "repository_report.json").read_text())["edits"]
    assert (mined["commits"], mined["held_out_commits"], mined["examples"]) == (6, 1, 0)
    assert mined["tree_at"] == history(repo)[-2][0]
    assert (held / "tree" / "calc.py").read_text() == BEFORE + PADDING
