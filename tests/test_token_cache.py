"""The token cache of the user's code (`engine.token_cache`): what it counts, what it finds, how the engine mixes the
document's own and its workspace's into a request, and where a document's workspace is."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from canvas_ls.engine import Engine
from canvas_ls.engine.paths import document_repository
from canvas_ls.engine.token_cache import Caches, TokenCache, lookups, mix_cache


def test_the_cache_finds_the_longest_context_it_holds_and_never_one_across_files() -> None:
    files = [[5, 6, 7, 8, 9], [5, 6, 7, 3], [1, 2, 7, 4]]
    cache = TokenCache(np.array([t for f in files for t in [*f, -1]][:-1]), orders=(3, 2))
    assert cache.tokens == 13
    ids, counts = cache.following([5, 6, 7])  # order 3: 8 once, 3 once
    assert ids.tolist() == [3, 8] and counts.tolist() == [1, 1]
    ids, counts = cache.following([0, 2, 7])  # [0, 2, 7] unseen: falls back to [2, 7] -> 4
    assert ids.tolist() == [4]
    assert cache.following([9, 5]) is None  # the end of one file and the start of the next are not a context
    assert cache.following([7]) is None  # shorter than the shortest order


def test_caches_read_as_one_answer_from_the_longest_context_the_first_that_holds_it() -> None:
    document = TokenCache(np.array([5, 6, 7, 8, -1, 0, 6, 7, 8]), orders=(3, 2))
    workspace = TokenCache(np.array([5, 6, 7, 3, -1, 6, 7, 3, -1, 9, 7, 4, -1, 1, 9, 7, 4]), orders=(3, 2))
    both = Caches([(document, 4.0), (workspace, 1.0)])
    ids, counts = both.following([5, 6, 7])  # order 3 in both: the document's, its counts x4
    assert ids.tolist() == [8] and counts.tolist() == [4]
    assert both.following([1, 9, 7])[0].tolist() == [4]  # order 3 in the workspace beats order 2 in the document
    assert both.following([0, 9, 7])[0].tolist() == [4]  # order 2, the workspace alone
    assert Caches([(document, 1.0)]).following([1, 2]) is None


def test_a_documents_cache_holds_the_code_nearest_its_gap_within_the_budget() -> None:
    cache = TokenCache.of_document(list(range(100, 120)), [list(range(200, 210)), [300, 301]], budget=16)
    assert cache.tokens == 16  # 4 after the gap (a quarter), 12 before it
    assert cache.following([107, 108]) is None and cache.following([108, 109]) is not None  # before: its last 12
    assert cache.following([201, 202])[0].tolist() == [203] and cache.following([202, 203]) is None  # after: 4
    assert cache.following([119, 200]) is None  # the gap is between them: no context across it
    assert TokenCache.of_document([1, 2, 3], [[]], budget=16).tokens == 3


def test_mixing_moves_the_mass_where_the_code_went_but_leaves_the_end_of_the_answer_and_barred_tokens() -> None:
    cache = TokenCache(np.array([1, 2, 3] * 10), orders=(2,))  # after (1, 2) always 3; after (2, 3) always 1
    rows = torch.zeros(3, 6)
    rows[1, 1] = -1e4  # barred (token healing)
    rows[0, 4] = -1e4  # barred in a slot the cache moves: still never drawn
    found = [(0, *cache.following([1, 2])), (1, *cache.following([2, 3]))]
    changed = mix_cache(rows, found, weight=1.0, barred_below=-5e3, stop_ids=torch.tensor([5]))
    probabilities = torch.softmax(rows, dim=-1)
    assert changed == 1  # slot 1's only cached token is barred: its logits stay as they were
    lam = 10 / 11  # a context seen 10 times
    assert torch.isclose(probabilities[0, 3], torch.tensor((1 - lam) / 5 + lam * 4 / 5))
    assert torch.isclose(probabilities[0, 5], torch.tensor(1 / 5))  # the model's to say whether the answer ends
    assert probabilities[0, 4] == 0 and rows[0, 4] < -5e3
    assert torch.allclose(rows[2], torch.zeros(6))
    assert rows[1, 1] == -1e4 and torch.allclose(rows[1, [0, 2, 3, 4, 5]], torch.zeros(5))


def test_a_run_the_workspace_always_writes_is_looked_up_in_one_step() -> None:
    """A slot the cache alone makes near certain is the context of the next one within the same step (its token
    taken as written), unless its logits are barred; an uncertain one is not."""
    cache = TokenCache(np.array([1, 2, 3, 4] * 10), orders=(2,))
    sequence, known, positions = [1, 2, 0, 0, 0], [True, True, False, False, False], [2, 3, 4]
    chained = lookups(cache, sequence, known, positions, weight=1.0)
    assert [(slot, ids.tolist()) for slot, ids, _ in chained] == [(0, [3]), (1, [4]), (2, [1])]
    assert [slot for slot, _, _ in lookups(cache, sequence, known, positions, weight=0.5)] == [0]  # 0.45 < CHAIN
    assert [slot for slot, _, _ in lookups(cache, sequence, known, positions, 1.0, unchained=frozenset({0}))] == [0]
    assert sequence == [1, 2, 0, 0, 0] and known[2] is False  # the caller's lists are left as they were


def test_a_request_of_the_workspace_writes_what_the_workspace_writes_there(tiny_model_dir: Path) -> None:
    """The tiny random model writes noise after `return`; with the cache of a workspace where that function always
    returns the same call, the answer is that call (token by token: each slot's context becomes known as the slots
    before it are accepted). Without a workspace, or at weight 0, the same request is the model's own. (No space
    after `return`: the tiny tokenizer writes ` render` as a lone space and `r`..., and token healing bars a lone
    space in the first slot.)"""
    engine = Engine.load(str(tiny_model_dir), "cpu", dtype="float32")
    body = "".join(f"def handler_{i}(request):\n    return render(request, items)\n\n" for i in range(20))
    engine.token_caches.add("/ws", [body])
    prefix, suffix = "def handler(request):\n    return", "\n"
    settings = {"seed": 3, "max_new_tokens": 8}
    cached = engine.infill(prefix, suffix, settings, workspace="/ws")
    assert cached.text == " render(req"  # its 8 tokens
    plain = engine.infill(prefix, suffix, settings)
    assert plain.text != cached.text
    assert engine.infill(prefix, suffix, {**settings, "workspace_cache": 0}, workspace="/ws").text == plain.text


def test_a_request_writes_what_its_own_document_writes_before_and_after_the_gap(tiny_model_dir: Path) -> None:
    """No workspace: the document's own code is the cache, on either side of the gap (the editor's text, unsaved
    edits included); at weight 0 the answer is the model's own."""
    engine = Engine.load(str(tiny_model_dir), "cpu", dtype="float32")
    body = "".join(f"def handler_{i}(request):\n    return render(request, items)\n\n" for i in range(20))
    settings = {"seed": 3, "max_new_tokens": 8}
    gap = "def handler(request):\n    return"
    before = engine.infill(body + gap, "\n", settings)
    after = engine.infill(gap, "\n\n" + body, settings)
    assert before.text == after.text == " render(req"
    assert engine.infill(gap, "\n\n" + body, {**settings, "workspace_cache": 0}).text != after.text
    # The "prompt" layout (DiffusionGemma's): the first slot's context is the document's end, not the prompt's
    prompted = engine.infill(body + gap, "\n", {**settings, "layout": "prompt"})
    assert prompted.text == " render(req"


def test_a_workspaces_cache_is_built_in_the_background_from_its_repository(tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:  # fmt: skip
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    views = "".join(f"def view_{i}(request):\n    return render(request, 'index.html')\n\n" for i in range(3))
    (repo / "pkg" / "views.py").write_text(views)
    (repo / ".env").write_text("SECRET_KEY=abc\n")  # a secret: never read
    document = repo / "pkg" / "new.py"
    assert document_repository(document.as_uri()) == document_repository(str(document)) == str(repo)
    assert document_repository("untitled:Untitled-1") is None and document_repository(str(tmp_path / "x.py")) is None
    engine = Engine.load(str(tiny_model_dir), "cpu", dtype="float32")
    assert engine.token_caches.get(str(repo)) is None  # not built yet: the request runs without one
    deadline = time.monotonic() + 30
    while (cache := engine.token_caches.get(str(repo))) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cache is not None and cache.tokens == len(engine._encode(views))


def test_each_hole_of_a_fill_gets_the_workspace_where_its_context_is_known(tiny_model_dir: Path) -> None:
    """Several holes in one canvas: each gap's first slot reads the code before it (the prefix, or the clamped code
    between the holes) as its context."""
    from canvas_ls.engine.regions import Hole

    engine = Engine.load(str(tiny_model_dir), "cpu", dtype="float32")
    body = "".join(f"def handler_{i}(request):\n    return render(request, items)\n\n" for i in range(20))
    engine.token_caches.add("/ws", [body])
    middle = [Hole(), "\n\ndef other(request):\n    return", Hole()]
    settings = {"seed": 3, "max_steps": 16}
    result = engine.fill("def handler(request):\n    return", middle, "\n", settings, workspace="/ws")
    assert [gap.text[:7] for gap in result.gaps] == [" render", " render"], result.gaps


def test_the_least_recently_used_workspaces_cache_goes_beyond_the_bound() -> None:
    from canvas_ls.engine.token_cache import WorkspaceCaches

    caches = WorkspaceCaches(lambda text: [ord(c) for c in text])
    made = {name: TokenCache.from_texts([name * 3], caches.encode) for name in "abcd"}
    for name in "abc":
        caches.put(name, made[name])
    assert caches.get("a") is made["a"]  # used: now the most recent
    caches.put("d", made["d"])
    assert [caches._ready.get(name) is not None for name in "abcd"] == [True, False, True, True]
