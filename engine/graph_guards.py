"""What a saved decoder graph carries and checks (`compiled.py`'s whole graphs, `layer_graphs.py`'s per kind of
layer): the compile options that keep only the guards a saved graph can carry, the ahead-of-time compilation and
saving, the check of those guards against a step's inputs, and the layout of those inputs that lets a check serve
the steps of one batch."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .threads import full_threads


def compile_options(backend: str, guards: Callable[[list[Any]], list[bool]] | None) -> dict[str, Any] | None:
    """The CPU's compile options: inductor's C++ wrapper, and the filter of the guards a saved graph keeps."""
    options: dict[str, Any] = {"cpp_wrapper": True} if backend == "inductor" else {}
    if guards is not None:
        options["guard_filter_fn"] = guards
    return options or None


def save_ahead(compiled: Any, args: tuple[Any, ...], path: Path) -> None:
    """Compile `compiled` (a `torch.compile`d function, `fullgraph`, with `compile_options`'s guard filter) ahead of
    time on the example `args` (positional, then keyword), and save it to `path` (written whole, then renamed:
    engines compiling at once are safe). Traced outside inference mode, as the saved graphs run."""
    with torch._dynamo.config.patch(specialize_float=True), torch.inference_mode(False), torch.no_grad():
        graph = compiled.aot_compile(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    graph.save_compiled_function(str(path))


def guards_accept(graph: Any, *args: Any, **inputs: Any) -> bool:
    """Whether a saved graph's guards accept these inputs. The graphs are compiled with every thread, and their guards
    record the count (dynamo's global state): with fewer threads (`engine/threads.py`, a busy machine) they are
    checked as compiled, and run with fewer (their parallel regions take the caller's thread count; never more than
    they were built for)."""
    accepted = bool(graph.guard_check(*args, **inputs))
    if not accepted and torch.get_num_threads() < full_threads():
        current = torch.get_num_threads()
        torch.set_num_threads(full_threads())
        try:
            accepted = bool(graph.guard_check(*args, **inputs))
        finally:
            torch.set_num_threads(current)
    return accepted


# Guards a saved graph cannot carry (identities of this process's objects: modules, functions, classes). The file's
# name already pins what they would check: the model's architecture and dtype, torch, transformers, the CPU's kernels
# and the code that lays out the decoder's inputs (`graph_path`); weights are the graph's inputs, not constants.
_UNSAVABLE = {"ID_MATCH", "CLOSURE_MATCH", "FUNCTION_MATCH", "TYPE_MATCH", "CLASS_MATCH", "NN_MODULE", "DICT_VERSION",
              "MODULE_MATCH", "BUILTIN_MATCH"}  # fmt: skip


def serializable(entries: list[Any]) -> list[bool]:
    return [not (e.is_global or e.guard_type in _UNSAVABLE or _UNSAVABLE & set(e.derived_guard_types)) for e in entries]


def signature(inputs: dict[str, Any]) -> tuple[Any, ...]:
    """The layout of a forward's inputs other than its cache: each tensor's shape, strides and dtype (the masks are a
    dict of them, a layer's rotary embeddings a tuple), and any other value as it is."""

    def layout(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.shape, value.stride(), value.dtype
        if isinstance(value, dict):
            return tuple((key, layout(item)) for key, item in value.items())
        if isinstance(value, tuple | list):
            return tuple(layout(item) for item in value)
        return value

    return tuple((name, layout(value)) for name, value in inputs.items() if name != "cache")


class KeptCheck:
    """A saved graph's guard check, kept for the steps of one batch. Checking walks every input tensor, ~0.6 ms a step
    on 2 cores for a whole decoder (its caches cold after the forward), so the answer stands while the batched cache
    object (rebuilt whenever a job joins, leaves or extends its cache) and the shapes and strides of the other inputs
    (the row count, and so the graph, among them) stay the same, which the step lays out by the same code every
    time."""

    def __init__(self) -> None:
        self._kept: tuple[weakref.ref[Any], tuple[Any, ...], bool] | None = None

    def accepts(self, graph: Any, batched: Any, *args: Any, **inputs: Any) -> bool:
        """Whether `graph`'s guards accept `args` and `inputs`, the step's batched cache being `batched`."""
        layout = signature(inputs)
        kept = self._kept
        if kept is not None and kept[0]() is batched and kept[1] == layout:
            return kept[2]
        accepted = guards_accept(graph, *args, **inputs)
        self._kept = (weakref.ref(batched), layout, accepted)
        return accepted
