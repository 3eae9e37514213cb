"""The CPU's decoder compiled layer by layer: one saved graph per kind of decoder layer, serving every layer of it.

Compiling a decoder forward whole takes time in proportion to its depth: dynamo traces, and inductor lowers and
compiles, every layer again. A 24-layer model of Qwen2.5-Coder-0.5B's shape (`bench ar`'s) took 383 s to its
one-row graph and 781 s to both on a new machine (2-core Zen 4, bf16, 2026-12-07). Its layers are of two kinds
(sliding-window and full attention), so two graphs of one layer each stand for all 24: each is traced once with the
layer as an input (its weights are the graph's inputs, as the whole graph's are), and every layer of the kind runs
it with its own weights and its own slice of the batch's cache. What stays eager around them (the embedding,
self-conditioning, the final norm and LM head) is a few large operations, not per-op overhead.

A layer reads its cache by its index (`cache.layers[self.layer_idx]`), which a traced graph would bake in: each layer
runs its graph on a `OneLayerCache`, whose every index holds that layer's keys and values, and the graph is saved
without the guard on the index (`_layer_guards`). Layers are grouped by their type and their parameters' shapes and
dtypes (`layer_kinds`), so a graph never runs a layer it was not traced for.

Whole-graph or layer by layer (`by_layer`): a decoder of at least `BY_LAYER_FROM` layers compiles by layer. A shallow
one compiles whole: the shipped model's 4 layers are as many graphs as its kinds x rows, and the whole graph, free
of the eager parts between layers, steps faster. `CANVAS_LS_COMPILE_BY_LAYER=on|off` overrides the depth rule (`bench
warmup --by-layer` compares both). A CPU's int8-dynamic model compiles this way too (no whole graph can take fbgemm's
packed weights): each packed layer is one operator of its layer's graph (`quantize.packed_linear`).

Measured (2-core Zen 4, 2026-12-07, the 0.5B shape): both graphs ready 59.1 s after a new machine's start against
780.8 s whole (bf16); a forward 0.86x eager alone, 0.93x with two rows (bf16), 0.87x / 0.90x (int8-dynamic).
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .elementwise import eager_logits
from .graph_guards import KeptCheck, compile_options, save_ahead, serializable

BY_LAYER_FROM = 8  # decoder layers from which the CPU's graphs are compiled layer by layer


def by_layer(model: Any) -> bool:
    """Whether this model's decoder is compiled layer by layer (`CANVAS_LS_COMPILE_BY_LAYER`, else its depth)."""
    said = os.environ.get("CANVAS_LS_COMPILE_BY_LAYER", "auto")
    if said not in ("auto", "on", "off"):
        raise ValueError(f"CANVAS_LS_COMPILE_BY_LAYER must be one of auto, on, off, got '{said}'")
    return said == "on" or (said == "auto" and len(model.model.decoder.layers) >= BY_LAYER_FROM)


def layer_kinds(model: Any) -> dict[int, list[int]]:
    """The decoder's layers grouped by what one graph must share: the layer type, and its parameters' names, shapes
    and dtypes. Each group is named by its first layer's index."""
    types_ = model.config.get_text_config().layer_types
    groups: dict[tuple[Any, ...], list[int]] = {}
    for index, layer in enumerate(model.model.decoder.layers):
        shapes = tuple((name, tuple(p.shape), p.dtype) for name, p in layer.named_parameters())
        groups.setdefault((types_[index], shapes), []).append(index)
    return {indices[0]: indices for indices in groups.values()}


class OneLayerCache:
    """A batched cache (`canvas.BatchedKV`) seen by one layer: every index holds that layer's keys and values, so a
    graph traced on one layer reads the right cache for every layer of its kind."""

    is_compileable = False

    def __init__(self, layer: Any, depth: int):
        self.layers = [layer] * depth


class LayerGraphs:
    """The graphs of one row count (`compiled.ROWS`), one per kind of layer, in the shape of a whole saved graph:
    `graph(model, **inputs)` runs the decoder's forward with each layer on its kind's graph. Each kind's guards are
    checked as its first layer runs (`guard_check` accepts for them); a layer whose graph's guards refuse its inputs,
    or whose graph fails, runs eager within the same forward (a forward is not run twice: an int8 model's
    self-conditioning is handed to it once, `conditioning.SoftInput`). The output says how many did, and the
    failure."""

    def __init__(self, model: Any, graphs: dict[int, Any]):
        self.graphs = graphs  # first layer of a kind -> its loaded graph
        self._checks = {first: KeptCheck() for first in graphs}  # each kind's guard check, kept for a batch
        layers = model.model.decoder.layers
        kind_of = {index: first for first, indices in layer_kinds(model).items() for index in indices}
        self._forwards = [self._compiled_forward(index, layer, kind_of[index], len(layers))
                          for index, layer in enumerate(layers)]  # fmt: skip
        self._eager_layers = 0
        self._error: Exception | None = None

    def guard_check(self, model: Any, **inputs: Any) -> bool:
        return True

    def __call__(self, model: Any, **inputs: Any) -> types.SimpleNamespace:
        """The decoder's logits, its layers on their graphs (`eager_layers`: how many ran eager; `error`: a graph's
        failure, after which the rest ran eager)."""
        layers = model.model.decoder.layers
        self._eager_layers, self._error = 0, None
        try:
            for layer, forward in zip(layers, self._forwards, strict=True):
                layer.forward = forward
            logits = eager_logits(model, inputs)
        finally:
            for layer in layers:
                layer.__dict__.pop("forward", None)
        return types.SimpleNamespace(logits=logits, eager_layers=self._eager_layers, error=self._error)

    def _compiled_forward(self, index: int, layer: Any, kind: int, depth: int) -> Callable[..., torch.Tensor]:
        """Layer `index`'s forward on its kind's graph; its guards checked as the kind's are, for a batch: the layers
        of a kind share their parameters' shapes, so what one accepts the others do."""
        check = self._checks[kind]

        def forward(hidden_states: torch.Tensor, cache: Any, **inputs: Any) -> torch.Tensor:
            one, graph = OneLayerCache(cache.layers[index], depth), self.graphs[kind]
            if self._error is None and check.accepts(graph, cache, layer, hidden_states=hidden_states, cache=one,
                                                     **inputs):  # fmt: skip
                try:
                    return graph(layer, hidden_states=hidden_states, cache=one, **inputs)
                except Exception as exc:  # a graph that fails costs the speed, never the step
                    self._error = exc
            self._eager_layers += 1
            return type(layer).forward(layer, hidden_states, cache=cache, **inputs)

        return forward


def layer_inputs(model: Any, inputs: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """What the first layer of each kind is called with in an eager forward on the decoder's `inputs`, its cache seen
    as `OneLayerCache`: the example a layer graph is traced on."""
    layers = model.model.decoder.layers
    kinds = layer_kinds(model)
    seen: dict[int, dict[str, Any]] = {}

    def capturing(index: int, original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def forward(hidden_states: torch.Tensor, cache: Any, **kwargs: Any) -> torch.Tensor:
            seen[index] = dict(hidden_states=hidden_states, cache=OneLayerCache(cache.layers[index], len(layers)),
                               **kwargs)  # fmt: skip
            return original(hidden_states, cache=cache, **kwargs)

        return forward

    try:
        for first in kinds:
            layers[first].forward = capturing(first, layers[first].forward)
        eager_logits(model, inputs)
    finally:
        for first in kinds:
            layers[first].__dict__.pop("forward", None)
    return seen


def _layer_forward(layer: Any, **inputs: Any) -> torch.Tensor:
    """What a layer graph traces: the layer's own forward (not a compiled stand-in set on it)."""
    return type(layer).forward(layer, **inputs)


def compile_layers(model: Any, inputs: dict[str, Any], backend: str, paths: dict[int | None, Path]) -> None:
    """Trace and compile one graph per kind of layer on what the decoder's `inputs` give each, saving each to its
    path in `paths` (keyed by the kind's first layer)."""
    layers = model.model.decoder.layers
    with torch.inference_mode(False), torch.no_grad():
        examples = layer_inputs(model, inputs)
    for first, example in examples.items():
        compiled = torch.compile(_layer_forward, dynamic=True, backend=backend, fullgraph=True,
                                 options=compile_options(backend, _layer_guards))  # fmt: skip
        save_ahead(compiled, ((layers[first],), example), paths[first])


def _layer_guards(entries: list[Any]) -> list[bool]:
    """The guards a layer graph keeps: those a saved graph can carry, less the layer's index (`OneLayerCache`)."""
    return [kept and "layer_idx" not in entry.name for kept, entry in zip(serializable(entries), entries, strict=True)]
