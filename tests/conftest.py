"""Shared fixtures: a tiny random DiffusionGemma model built on the spot (nothing is downloaded)."""

from __future__ import annotations

import os

# Triton kernels run in its interpreter, on the CPU, in tests (set before anything imports triton).
os.environ.setdefault("TRITON_INTERPRET", "1")
# Engines started with `compile: auto` (every resident engine the tests start) stay eager: a compiled step would
# spend a minute of the test machine's 2 cores compiling the tiny model's graphs per cache folder. The compiled
# path has its own tests (test_compiled.py), which ask for it by name.
os.environ.setdefault("CANVAS_LS_COMPILE", "off")

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Imported now, not lazily by its pytest plugin's end-of-session summary: CPython 3.11.7's ast.parse (pytest's
# assertion rewriting) can fail there with "AST constructor recursion depth mismatch" (fixed in 3.11.8).
import hypothesis
import pytest
from pygls.protocol import default_converter
from pytest_lsp import ClientServerConfig, LanguageClient
from pytest_lsp.client import register_lsp_features

from canvas_ls.engine import Engine
from canvas_ls.engine.architecture import build_tiny_model

# The fuzzers' budgets: each property a few seconds by default; `pytest --hypothesis-profile=long -o timeout=0
# tests/test_wire.py` runs each for many thousands of examples (about ten minutes a property on 2 cores).
hypothesis.settings.register_profile("long", max_examples=50_000, deadline=None)


def fuzz(examples: int) -> hypothesis.settings:
    """`examples` for a property in the default run; the long profile's count under `--hypothesis-profile=long`."""
    chosen = hypothesis.settings.default.max_examples
    return hypothesis.settings(max_examples=chosen if chosen >= 50_000 else examples, deadline=None,
                               suppress_health_check=[hypothesis.HealthCheck.too_slow])  # fmt: skip


REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "fixtures"


def tokenizer_texts() -> list[str]:
    """Text for the tiny tokenizer: the fixtures plus the standard library's json package."""
    files = sorted(p for p in FIXTURES.rglob("*") if p.is_file())
    files += sorted(Path(json.__file__).parent.glob("*.py"))
    return [p.read_text(encoding="utf-8") for p in files]


SERVE = [sys.executable, "-m", "canvas_ls.server.cli", "serve"]


async def end_session(client: Any, timeout_s: float = 30.0) -> None:
    """The end of a test's language server, whatever the test left: `shutdown` and `exit` where the session is up,
    and the process killed where it has not exited within `timeout_s`."""
    server = getattr(client, "_server", None)  # pygls keeps the process there; it offers no public handle
    if server is None or server.returncode is not None:
        return
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.shutdown_session(), timeout_s)
    if server.returncode is None:
        server.kill()
        await server.wait()


class EndingClient(LanguageClient):
    """pytest-lsp's test client, whose `stop` (every `pytest_lsp.fixture`'s teardown) ends the server first
    (`end_session`). pytest-lsp's own `stop` waits for the process to exit without a limit, and pytest-timeout stops
    timing a test once it has failed: a test that failed ahead of its `shutdown_session` (or never initialized)
    held its worker, and CI, until CI's own limit (1,040 s once)."""

    async def stop(self) -> Any:
        await end_session(self)
        return await super().stop()


def ending_client() -> EndingClient:
    """`make_test_lsp_client`, with `EndingClient`."""
    client = EndingClient(converter_factory=default_converter)
    register_lsp_features(client)
    return client


# The language server under test, as every `pytest_lsp.fixture` of the suite starts it
SERVER = ClientServerConfig(server_command=SERVE, client_factory=ending_client)


NOTHING_LOADED = "loaded: none of torch, transformers, a compiling process"


def refused_before_loading(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`canvas-ls ARGV` (the CLI's own `main`) in a new interpreter, which then prints whether torch, transformers or
    a compiling process (`compile_child.CompilerProcess`) had been loaded or started by the time it returned:
    `NOTHING_LOADED` for a refusal that comes at once, not after seconds of imports. Run with compile "auto" (the
    user's default, where a CPU engine starts the compiling process; the suite runs with it off) and no token."""
    code = ("import sys\n"
            "from canvas_ls.engine import compile_child\n"
            "started = []\n"
            "compile_child.CompilerProcess = lambda *a, **k: started.append(a)\n"
            "from canvas_ls.server.cli import main\n"
            "code = main(sys.argv[1:])\n"
            "loaded = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "loaded += ['a compiling process'] * bool(started)\n"
            "print('loaded:', ', '.join(loaded) or 'none of torch, transformers, a compiling process')\n"
            "sys.exit(code)\n")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "CANVAS_LS_COMPILE"} | {"CANVAS_LS_TOKEN": ""} | (env or {})
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL, env=env)  # fmt: skip


@pytest.fixture(scope="session", autouse=True)
def private_runtime_dir(tmp_path_factory: pytest.TempPathFactory):
    """Language servers start resident engines by default: in tests they live in a folder of their own (never the
    user's), and whatever engine the tests started is stopped at the end instead of idling for 30 minutes."""
    import signal

    import httpx

    folder = tmp_path_factory.mktemp("runtime")
    previous = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = str(folder)
    yield folder
    for socket in (folder / "canvas-ls").glob("*.sock"):
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), timeout=2) as client:
                os.kill(client.get("http://engine/health").json()["pid"], signal.SIGKILL)
        except (httpx.HTTPError, OSError, ValueError, KeyError):
            pass
    if previous is None:
        os.environ.pop("XDG_RUNTIME_DIR", None)
    else:
        os.environ["XDG_RUNTIME_DIR"] = previous


@contextlib.contextmanager
def private_folder(tmp_path_factory: pytest.TempPathFactory, variable: str) -> Iterator[Path]:
    """`variable` (an XDG folder) pointed at a folder of the tests' own, for the test process and every server or
    engine it starts; put back after."""
    folder = tmp_path_factory.mktemp(variable.lower())
    previous = os.environ.get(variable)
    os.environ[variable] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop(variable, None)
    else:
        os.environ[variable] = previous


@pytest.fixture(scope="session", autouse=True)
def private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The user's cache (training runs, reports, workspace models) in a folder of the tests' own."""
    with private_folder(tmp_path_factory, "XDG_CACHE_HOME") as folder:
        yield folder


@pytest.fixture(scope="session", autouse=True)
def private_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The user's state folder (the acceptance statistics' database) in a folder of the tests' own."""
    with private_folder(tmp_path_factory, "XDG_STATE_HOME") as folder:
        yield folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny"),
        tokenizer_texts(),
        infill={"layout": "canvas", "gap_tokens": 8, "max_new_tokens": 16},
    )


@pytest.fixture(scope="session")
def writing_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, asking (in its canvas_ls.json) for answers of at least one token: the end-to-end tests check
    the edits that reach the editor, and a random model may well answer nothing at their cursors."""
    return build_tiny_model(
        tmp_path_factory.mktemp("writing"),
        tokenizer_texts(),
        infill={"layout": "canvas", "gap_tokens": 8, "max_new_tokens": 16, "min_new_tokens": 1},
    )


@pytest.fixture(scope="session")
def fixed_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose answers are known in advance, for the real editors' tests: it writes "code" in every slot
    whatever the context, and " None" where token healing bars "code" (the first slot after a space the cursor
    follows); answers of at most 4 tokens. After `return ` it answers "Nonecodecodecode" (valid Python: the server's
    syntax check keeps it)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("fixed"),
        tokenizer_texts(),
        infill={"layout": "canvas", "gap_tokens": 8, "max_new_tokens": 4},
        writes=("code", " None"),
    )


@pytest.fixture(scope="session")
def ending_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose every answer is one word, then the end: it ranks EOS first, "code" second and " None"
    third in every slot, and its canvas_ls.json bars EOS from each gap's first slot (min_new_tokens 1). Every gap is
    filled with "code", or "None" where the prefix ends with a space (token healing re-writes it: " None"), and
    closed: fills and completions whose outcome the tests know."""
    return build_tiny_model(
        tmp_path_factory.mktemp("ending"),
        tokenizer_texts(),
        infill={"layout": "canvas", "gap_tokens": 8, "max_new_tokens": 16, "min_new_tokens": 1},
        writes=("<eos>", "code", " None"),
    )


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Path) -> Engine:
    return Engine.load(str(tiny_model_dir), "cpu")


@pytest.fixture(scope="session")
def tiny_engine_fp32(tiny_model_dir: Path) -> Engine:
    """For checks of exact equivalence (batched vs alone): bf16 rounds a batched matmul a hair differently, and
    the random tiny model's near-tied logits flip on such hairs."""
    return Engine.load(str(tiny_model_dir), "cpu", dtype="float32")


def random_adapter(model_dir: Path, out: Path, seed: int = 3, experts: bool = False) -> Path:
    """A LoRA adapter of the model whose weights are random (a fresh LoRA's B is zero: it would change nothing)."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    from canvas_ls.engine.adapters import add_lora, save_adapter

    torch.manual_seed(seed)
    adapted = add_lora(DiffusionGemmaForBlockDiffusion.from_pretrained(str(model_dir)), rank=4, experts=experts)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    return save_adapter(adapted, out)


@pytest.fixture(scope="session")
def linear_adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two adapters of the tiny model's attention and dense MLP (what `train --workspace` tunes on a base too big
    to tune fully): what one engine holds side by side."""
    return [random_adapter(tiny_model_dir, tmp_path_factory.mktemp(f"linear{seed}"), seed) for seed in (3, 4)]


@pytest.fixture(scope="module")
def shared() -> Iterator[Any]:
    """One `canvas-ls serve` over raw stdio (tests/test_stdio_robustness.py's client, initialized) for a module's tests
    that only send frames and read their answers."""
    from tests.test_stdio_robustness import start

    client = start()
    yield client
    client.process.kill()
    client.process.wait()
