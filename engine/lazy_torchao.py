"""torchao (the `quantize` extra) only where quantised weights are asked for.

Where torchao is installed, transformers imports it in every process that loads a model (its torchao quantizer's
module does, at import): +0.3 s at each start (transformers' import 4.75 vs 4.39 s on a 2-core Xeon), and the CPU
engine measured ~3% slower with it loaded (`bench neovim`, engine p50 131-135 vs 125-128 ms). So until
`want_torchao` is called (a quantised load, `quantize.torchao_config`), transformers' `is_torchao_available` says
no: a hook on the import of `transformers.utils.import_utils` wraps it as the module loads, before any other
transformers module takes the name. Nothing here imports transformers or torch.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

_wanted = False
MODULE = "transformers.utils.import_utils"


def want_torchao() -> None:
    """From now on transformers sees torchao as installed (when it is)."""
    global _wanted
    _wanted = True


def _on_demand(available: Callable[..., bool]) -> Callable[..., bool]:
    def is_torchao_available(*args: Any, **kwargs: Any) -> bool:
        return _wanted and available(*args, **kwargs)

    return is_torchao_available


class _Hook(importlib.abc.MetaPathFinder):
    """Finds `transformers.utils.import_utils` as the path finder does, and wraps its `is_torchao_available` once
    the module has run."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            if callable(getattr(module, "is_torchao_available", None)):
                module.is_torchao_available = _on_demand(module.is_torchao_available)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Put the hook first on the import path, once, unless transformers is already imported (then nothing)."""
    if MODULE not in sys.modules and not any(isinstance(finder, _Hook) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Hook())
