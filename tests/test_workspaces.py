"""Models tuned on a workspace: the registry under the user's cache, the language server answering a repository's
files with its model, "Learn this workspace" end to end, and `bench repo` on the tiny model."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import pytest_lsp
import torch
from lsprotocol import types
from pytest_lsp import LanguageClient

from canvas_ls.engine import workspaces
from tests.conftest import SERVER, random_adapter, tokenizer_texts
from tests.test_lsp import options, request, wait_ready

RETURN_DOC = "def f(x):\n    return \n"
AFTER_RETURN = types.Position(line=1, character=11)


@pytest.fixture
def replay_corpus(private_cache_dir: Path) -> Path:
    """The general code a repository run replays (`corpus.replay_files`), already in the tests' cache: a small one
    (collecting this machine's takes 20-40 s)."""
    from canvas_ls.engine import corpus

    path = private_cache_dir / "canvas-ls" / "replay-corpus.jsonl.gz"
    if not path.is_file():
        corpus.save([corpus.CorpusFile(f"g{i}.py", "python", "test", t) for i, t in enumerate(tokenizer_texts())],
                    path)  # fmt: skip
    return path


def fake_run(folder: Path, weights: Path | None = None) -> Path:
    """A finished training run's folder: its model/ (a copy of `weights`, or an empty stand-in)."""
    if weights is not None:
        shutil.copytree(weights, folder / "model")
    else:
        (folder / "model").mkdir(parents=True)
        (folder / "model" / "config.json").write_text("{}")
    return folder


def test_an_installed_model_serves_its_repository_and_nothing_else(tmp_path: Path) -> None:
    outer, inner = tmp_path / "code", tmp_path / "code" / "libs" / "inner"
    inner.mkdir(parents=True)
    index = workspaces.WorkspaceIndex()
    assert index.for_path(outer / "a.py", None) is None
    summary = {"step": 7, "elapsed": 90.0, "repository": {"files": 3, "train_tokens": 1234},
               "eval_before_diffusion": 3.0, "eval_diffusion": 2.5}  # fmt: skip
    workspaces.install(outer, fake_run(tmp_path / "run1"), None, summary, {"name": "full"})
    assert index.for_path(outer / "pkg" / "a.py", None) is None  # memory only, until the index is refreshed
    assert index.refresh() and not index.refresh()  # re-read once: nothing changed since
    entry = index.for_path(outer / "pkg" / "a.py", None)
    assert entry is not None and entry.root == outer and entry.adapter is None
    assert entry.record["tokens"] == 1234 and entry.record["held_out"] == {"before": {"diffusion": 3.0},
                                                                            "after": {"diffusion": 2.5}}  # fmt: skip
    assert index.for_path(tmp_path / "elsewhere.py", None) is None
    assert index.for_path(outer / "a.py", "some/other-model") is None  # tuned from another base: not used
    # the innermost repository wins
    workspaces.install(inner, fake_run(tmp_path / "run2"), None, {}, {"name": "full"})
    index.refresh()
    assert index.for_path(inner / "b.py", None).root == inner
    assert index.for_path(outer / "a.py", None).root == outer
    # installing again replaces the weights under a new name (an engine of the old ones is never reused)
    first = entry.model
    workspaces.install(outer, fake_run(tmp_path / "run3"), None, {}, {"name": "full"})
    index.refresh()
    again = index.for_path(outer / "a.py", None)
    assert again.model != first and not Path(first).exists() and Path(again.model).is_dir()
    # (other tests of this worker install theirs in the same user cache: only this test's are counted)
    assert {e.root for e in workspaces.installed() if tmp_path in e.root.parents} == {outer, inner}
    assert workspaces.remove(inner) and index.refresh() and index.for_path(inner / "b.py", None).root == outer
    assert not workspaces.remove(inner)


def test_a_finished_run_starts_anew_and_an_interrupted_one_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.jsonl").write_text(json.dumps({"final": {"stopped": "interrupted"}}) + "\n")
    workspaces.fresh_run(run)
    assert run.is_dir()
    (run / "log.jsonl").write_text(json.dumps({"final": {"stopped": "budget"}}) + "\n")
    workspaces.fresh_run(run)
    assert not run.exists()


@pytest_lsp.fixture(config=SERVER)
async def raw_client(lsp_client: LanguageClient):
    yield


def open_file(client: LanguageClient, path: Path, text: str) -> str:
    uri = path.as_uri()
    client.text_document_did_open(types.DidOpenTextDocumentParams(types.TextDocumentItem(uri, "python", 1, text)))
    return uri


async def fill_at(client: LanguageClient, uri: str, position: types.Position) -> dict[str, Any]:
    where = {"line": position.line, "character": position.character}
    return await request(client, "canvas/fill", {"textDocument": {"uri": uri}, "position": where})


async def wait_for(condition: Any, timeout: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.2)


async def inside_and_outside(client: LanguageClient, model: Path, repo: Path, tmp_path: Path) -> tuple[str, str]:
    """A session with `model` configured, and the same document opened in `repo` and outside it (their URIs)."""
    capabilities = pytest_lsp.client_capabilities("neovim")
    init = options(model, max_steps=4, max_new_tokens_single_line=4)
    await client.initialize_session(types.InitializeParams(capabilities=capabilities, initialization_options=init))
    await wait_ready(client)
    return (open_file(client, repo / "pkg" / "a.py", RETURN_DOC),
            open_file(client, tmp_path / "elsewhere" / "a.py", RETURN_DOC))  # fmt: skip


async def test_a_repositorys_files_are_answered_by_its_own_model(
    raw_client: LanguageClient, writing_model_dir: Path, fixed_model_dir: Path, tmp_path: Path
) -> None:
    """The configured model is the random one; the repository's model (installed as tuned from it) writes
    "Nonecodecodecode" after `return `: once it has loaded, the repository's files get its answer, other files
    the configured model's."""
    repo = tmp_path / "repo"
    repo.mkdir()
    workspaces.install(repo, fake_run(tmp_path / "run", fixed_model_dir), str(writing_model_dir), {}, {"name": "t"})
    inside, outside = await inside_and_outside(raw_client, writing_model_dir, repo, tmp_path)
    first = await fill_at(raw_client, inside, AFTER_RETURN)  # starts the repository's engine; answered meanwhile
    assert not first["source"].startswith("error"), first

    async def loaded() -> bool:
        stats = await request(raw_client, "canvas/stats", {})
        return [m["state"] for m in stats["workspaceModels"]] == ["ready"]

    await wait_for(loaded, 120)
    answer = await fill_at(raw_client, inside, AFTER_RETURN)
    assert answer["edit"]["text"] == "Nonecodecodecode", answer
    other = await fill_at(raw_client, outside, AFTER_RETURN)
    assert (other["edit"] or {}).get("text") != "Nonecodecodecode" and not other["source"].startswith("error")
    assert other["result"] is None or other["result"]["model"] != answer["result"]["model"]
    stats = await request(raw_client, "canvas/stats", {})
    assert stats["workspaceModels"][0]["model"].startswith(str(workspaces.entry_dir(repo)))
    await raw_client.shutdown_session()


async def test_a_repositorys_adapter_is_answered_by_the_engine_of_its_base(
    raw_client: LanguageClient, writing_model_dir: Path, tmp_path: Path
) -> None:
    """A repository tuned as a LoRA adapter of the configured model (what "Learn this workspace" makes of a base too
    big to tune fully): its files are answered by the engine already running that model, with the adapter (no
    engine of its own, no second copy of the base); other files without it."""
    repo = tmp_path / "repo"
    random_adapter(writing_model_dir, tmp_path / "run" / "adapter")
    workspaces.install(repo, tmp_path / "run", str(writing_model_dir), {}, {"name": "lora", "lora_rank": 4})
    entry = workspaces.WorkspaceIndex().for_path(repo / "a.py", str(writing_model_dir))
    assert entry is not None and entry.kind == "adapter" and entry.shares_base
    inside, outside = await inside_and_outside(raw_client, writing_model_dir, repo, tmp_path)
    answer = await fill_at(raw_client, inside, AFTER_RETURN)
    assert answer["result"]["adapter"] == entry.adapter, answer
    other = await fill_at(raw_client, outside, AFTER_RETURN)
    assert other["result"]["adapter"] is None and other["result"]["model"] == answer["result"]["model"]
    stats = await request(raw_client, "canvas/stats", {})
    assert stats["workspaceModels"] == []  # no backend, no engine of its own
    await raw_client.shutdown_session()


# The learning runs at SCHED_IDLE (`paths.lowest_priority`): only on a core nothing else wants, so its minutes
# stretch while the other worker's tests hold both cores (241 s once, with one more process spinning).
@pytest.mark.timeout(600)
async def test_learn_this_workspace_tunes_installs_and_lists_the_model(
    raw_client: LanguageClient, writing_model_dir: Path, tmp_path: Path, replay_corpus: Path
) -> None:
    """The editors' command: a background `train --workspace` at the lowest priority, its progress reported, a
    message when it ends, the model installed (`canvas-ls models` lists it) and used for the repository's files."""
    repo = tmp_path / "project"
    for number, text in enumerate(tokenizer_texts()[:12]):
        (repo / "pkg").mkdir(parents=True, exist_ok=True)
        # files of 40 lines: the held-out ones give the calibration a few dozen lines (a minute with 200)
        (repo / "pkg" / f"m{number}.py").write_text("".join(text.splitlines(keepends=True)[:40]))
    capabilities = pytest_lsp.client_capabilities("neovim")
    init = options(writing_model_dir, max_steps=4)
    init["engine"]["learn_minutes"] = 0.05
    await raw_client.initialize_session(types.InitializeParams(capabilities=capabilities, initialization_options=init))
    await wait_ready(raw_client)
    command = types.ExecuteCommandParams("canvas-ls.learnWorkspace", [{"folder": repo.as_uri()}])
    started = await raw_client.workspace_execute_command_async(command)
    assert dict(started._asdict() if hasattr(started, "_asdict") else started) == {"workspace": str(repo.resolve()),
                                                                                   "minutes": 0.05}  # fmt: skip
    again = await raw_client.workspace_execute_command_async(command)
    assert "already learning" in (again._asdict() if hasattr(again, "_asdict") else again)["error"]

    async def said() -> bool:
        return any("learn" in m.message for m in raw_client.messages)

    await wait_for(said, 540)
    message = next(m for m in raw_client.messages if "learn" in m.message)
    assert message.type == types.MessageType.Info and message.message.startswith("canvas-ls: learned project: ")
    assert "its files now use this model" in message.message
    assert "held-out loss where the editor asks " in message.message and "on random spans " in message.message
    assert "; while typing it shows answers whose " in message.message  # its own threshold, from held-out lines
    reports = [r for token, values in raw_client.progress_reports.items() if "learn" in str(token) for r in values]
    assert isinstance(reports[0], types.WorkDoneProgressBegin) and reports[0].cancellable
    assert isinstance(reports[-1], types.WorkDoneProgressEnd)
    listed = subprocess.run([sys.executable, "-m", "canvas_ls.server.cli", "models", "--json"], capture_output=True,
                            text=True, check=True)  # fmt: skip
    rows = {row["workspace"]: row for row in json.loads(listed.stdout)}
    row = rows[str(repo.resolve())]
    assert row["kind"] == "model" and row["base"] == str(writing_model_dir) and row["steps"] >= 1
    assert row["files"] >= 2 and row["tokens"] > 0 and row["recipe"] == workspaces.WORKSPACE_RECIPE
    for when in ("before", "after"):  # the loss of what the workspace recipe trains on, and the general one
        assert {"editor_diffusion", "diffusion"} <= set(row["held_out"][when]), row["held_out"]
    display = json.loads((Path(row["model"]) / "canvas_ls.json").read_text())["display"]  # written into the model
    line, block = row["display"]["policy"]["single_line"], row["display"]["policy"]["multi_line"]
    assert (line["score"], line["threshold"]) == (display["score"], display["min_confidence"])
    assert display["multi_line"] == {"score": block["score"], "min_confidence": block["threshold"]}
    assert display["calibrated"]["set"] == "project (held-out files)" and row["display"]["lines"] >= 1
    inside = open_file(raw_client, repo / "pkg" / "m0.py", RETURN_DOC)
    await fill_at(raw_client, inside, AFTER_RETURN)
    stats = await request(raw_client, "canvas/stats", {})
    assert stats["learning"] == [] and len(stats["workspaceModels"]) == 1
    await raw_client.shutdown_session()


def test_bench_repo_measures_each_recipe_against_minutes(tiny_model_dir: Path, tmp_path: Path,
                                                         replay_corpus: Path) -> None:  # fmt: skip
    from canvas_ls.bench import repo as bench_repo

    repo = tmp_path / "repo"
    for number, text in enumerate(tokenizer_texts()[:10]):
        (repo / "pkg").mkdir(parents=True, exist_ok=True)
        (repo / "pkg" / f"m{number}.py").write_text(text)
    report = bench_repo.run(repo, tmp_path / "work", str(tiny_model_dir), ["full+cache", "lora", "cache"], minutes=0.08,
                            points=(0.03,), limits={"lines": 3, "blocks": 2, "humaneval": 0},
                            progress=lambda line: None)  # fmt: skip
    assert report["tasks"] == {"lines": 3, "blocks": 2}
    for name in ("full", "lora"):
        curve = report["recipes"][name]["curve"]
        assert [point["minutes"] for point in curve[:2]] == [0.0, 0.03] and len(curve) == 3, curve
        assert all(isinstance(point["held_out_loss"], float) for point in curve)
        assert all(0 <= point["lines"]["edit_similarity"] <= 1 for point in curve)
    assert (tmp_path / "work" / "lora" / "snapshots" / "0.03" / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "work" / "full" / "snapshots" / "0.03" / "model" / "config.json").is_file()
    # the repository's token cache: with the base (no training) and with full's final model (trained once)
    assert list(report["recipes"]) == ["full", "full+cache", "lora", "cache"]
    assert report["recipes"]["cache"]["steps"] == 0 and report["recipes"]["cache"]["recipe"]["token_cache_tokens"] > 0
    for name in ("cache", "full+cache"):
        curve = report["recipes"][name]["curve"]
        assert len(curve) == 2 and curve[0]["minutes"] == 0.0 and "lines" in curve[-1]
    table = bench_repo.format_repo(report)
    assert table.count("\nfull ") == 2 and table.count("\nlora ") == 2 and "\ncache " in table and "best: " in table
    # the best's gain comes with its interval over the same held-out lines, paired with the base's answers
    best = report["best"]
    low, high = best["lines_similarity_interval"]
    assert low <= best["lines_similarity_gain"] <= high and "95% " in table
    assert bench_repo.plot_repo(report, tmp_path / "repo.png").stat().st_size > 1000


def test_a_base_too_big_to_tune_fully_learns_an_adapter(tiny_model_dir: Path, monkeypatch) -> None:
    """`train --workspace` on a model whose full training cannot fit the device (DiffusionGemma on one GPU) takes the
    LoRA recipe; the shipped model, megabytes, always trains fully."""
    from canvas_ls.engine import plan
    from canvas_ls.server.learning import TrainRequest, fits_fully, policy

    request = TrainRequest(workspace=Path("."), start_from=str(tiny_model_dir))
    assert fits_fully(request) and policy(request).recipe == workspaces.WORKSPACE_RECIPE
    monkeypatch.setattr(plan, "available_bytes", lambda device: (1 << 20, "a 1 MiB device"))
    assert not fits_fully(request)
    chosen = policy(request)
    assert (chosen.recipe, chosen.overrides["quantize"]) == ("lora", "none")  # nothing fits: the run's check says why
    assert chosen.notes[0].startswith("training every weight of ") and chosen.notes[0].endswith("(recipe lora)")
    assert fits_fully(TrainRequest(workspace=Path(".")))  # the shipped model


def test_every_recipe_is_a_training_configuration() -> None:
    """`train --recipe NAME` and `bench repo` build a TrainConfig from each recipe (`workspaces.recipe`: the replay
    share apart, also when `--replay` overrides it): a misspelt field would fail a user's run minutes in, not here."""
    from canvas_ls.engine.training import TrainConfig

    for name in workspaces.RECIPES:
        fields, replay = workspaces.recipe(name)
        cfg = TrainConfig(**fields)
        assert all(getattr(cfg, k) == v for k, v in fields.items()), name
        assert 0.0 <= replay < 1.0, name
    assert workspaces.WORKSPACE_RECIPE in workspaces.RECIPES


def test_the_training_plan_is_the_recipes() -> None:
    """`train --plan --recipe NAME` counts the run that recipe makes: a moving average's copy of the weights, a LoRA
    recipe's adapter."""
    from canvas_ls.server import cli, learning, train_cli

    def plan_of(*argv: str) -> Any:
        return learning.plan_config(train_cli.request(cli.parser().parse_args(["train", "--plan", *argv])))

    assert plan_of("--recipe", "editor-ema").ema == workspaces.RECIPES["editor-ema"]["ema"] > 0
    assert plan_of("--recipe", "lora").lora_rank == workspaces.RECIPES["lora"]["lora_rank"]
    assert plan_of("--recipe", "lora", "--lora", "4").lora_rank == 4  # the flags over the recipe
    assert plan_of().ema == 0.0  # no recipe: the preset's
    workspace = workspaces.recipe(workspaces.WORKSPACE_RECIPE)[0]
    assert all(getattr(plan_of("--workspace", "."), k) == v for k, v in workspace.items())
    # the precision the run trains in on this machine (`as_run`: fp32 on a CPU where bf16 is emulated)
    from canvas_ls.engine.loading import cpu_has_native_bf16

    assert plan_of().bf16 is (torch.cuda.is_available() or cpu_has_native_bf16()) and plan_of("--fp32").bf16 is False


def test_the_learned_message_says_what_the_tuned_model_will_show() -> None:
    from canvas_ls.server.lsp import _shown_while_typing

    policy = {"single_line": {"score": "mean", "threshold": 0.9631, "target_met": True},
              "multi_line": {"score": "anchored", "threshold": 0.9214, "target_met": False}}  # fmt: skip
    calibrated = {"policy": policy, "held_out_precision": 0.55, "held_out_coverage": 0.2}
    assert _shown_while_typing(calibrated) == (
        "; while typing it shows answers whose mean score is at least 0.96 on a begun line, and whose anchored score "
        "is at least 0.92 on a blank line: 20% of the held-out lines, 55% of them good"
    )
    blocks_hidden = {**calibrated, "policy": {**policy, "multi_line": {**policy["multi_line"], "threshold": 1.0}}}
    assert _shown_while_typing(blocks_hidden).startswith(
        "; while typing it shows answers whose mean score is at least 0.96 on a begun line, and whose anchored score "
        "is at least 1.00 on a blank line (none do: nothing is shown there): "
    )
    nothing = {**calibrated, "held_out_precision": None, "held_out_coverage": 0.0}
    assert _shown_while_typing(nothing).endswith("(none of the held-out lines reached it)")
    failed = {"error": "OSError: no space left on device"}
    assert _shown_while_typing(failed) == "; its display threshold stays the base's (OSError: no space left on device)"
    assert _shown_while_typing(None) == ""  # an adapter or an interrupted run: nothing was calibrated


def process_state(pid: int) -> str:
    """A process's state letter from /proc (S sleeping, T stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


async def state_of(pid: int, state: str, timeout: float = 10) -> bool:
    """Whether the process reaches `state` (its /proc state letter) within `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while process_state(pid) != state:
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def test_a_learning_run_is_stopped_while_the_model_answers_and_resumed_after() -> None:
    """`Learner.hold` (a model call starts) stops every run with SIGSTOP; `release` continues them once
    `resume_after_s` has passed without another call; `interrupt` of a held run continues it so that it sees its
    SIGINT. The run here is a real child process (a sleeping Python), started as the learner starts its runs, by a
    server that ignores SIGINT (one started in a shell's background: a run that inherited that once slept through
    its interrupt)."""
    from canvas_ls.server.workspaces import Learner, LearnJob, _interrupted_with_parent

    learner = Learner(resume_after_s=0.2)
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        child = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; print(flush=True); "
                                                     "time.sleep(60)", stdout=asyncio.subprocess.PIPE,
                                                     preexec_fn=_interrupted_with_parent)  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, ignored)
    job = learner.jobs[Path("/repo")] = LearnJob(Path("/repo"), child)
    try:
        assert child.stdout is not None and await asyncio.wait_for(child.stdout.readline(), 30) == b"\n"  # running
        learner.hold()
        assert job.held and await state_of(child.pid, "T")
        learner.release()
        held = asyncio.get_running_loop().time()
        learner.hold()  # another call within resume_after_s: still stopped
        learner.release()
        assert await state_of(child.pid, "S") and asyncio.get_running_loop().time() - held >= 0.2
        assert not job.held
        learner.hold()
        learner.interrupt(Path("/repo"))  # stopped when interrupted: continued, so that the SIGINT ends it
        assert await asyncio.wait_for(child.wait(), 10) != 0 and job.interrupted and not job.held
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()


def test_retargeting_the_default_backend_drops_the_old_base_s_workspace_models() -> None:
    from canvas_ls.server.workspaces import RoutedBackend

    class Stub:
        def __init__(self) -> None:
            self.stopped = False

        def shutdown(self) -> None:
            self.stopped = True

    old = Stub()
    routed = RoutedBackend(Stub(), lambda model, adapter: Stub(), "base-a", True)  # type: ignore[arg-type]
    routed.workspace_backends[("tuned-from-a", None)] = old  # type: ignore[assignment]
    routed.retarget("base-b", False)
    assert (routed.base, routed.enabled, routed.workspace_backends, old.stopped) == ("base-b", False, {}, True)
