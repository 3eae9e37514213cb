"""canvas-ls engine: fills a gap in code by denoising a canvas with a DiffusionGemma-architecture model.

Public names (everything else is internal), loaded on first use so that light modules such as
`engine.paths` import without torch:
  Engine, InfillResult, InfillCancelled -- text in, result out (engine.engine)
  Hole, FillError                       -- several holes (and span rewrites) in one canvas (engine.regions)
  InfillSettings, SettingsError         -- the knobs (engine.settings)
  ModelLoadError                        -- a model that cannot load (engine.errors, no torch)
  DEFAULT_MODEL_DIR                     -- loading (engine.loading)
"""

import logging
from importlib import import_module
from typing import Any

from . import lazy_torchao

# transformers would import torchao (the `quantize` extra) in every process where it is installed: only where
# quantised weights are asked for (`lazy_torchao`). torchao warns at import about CUDA extensions a CPU-only torch
# cannot load and about a deprecated torch call: nothing a user can act on.
lazy_torchao.install()
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

_PUBLIC = {
    "DEFAULT_MODEL_DIR": "canvas_ls.engine.loading",
    "Engine": "canvas_ls.engine.engine",
    "FillError": "canvas_ls.engine.regions",
    "Hole": "canvas_ls.engine.regions",
    "InfillCancelled": "canvas_ls.engine.canvas",
    "InfillResult": "canvas_ls.engine.results",
    "InfillSettings": "canvas_ls.engine.settings",
    "ModelLoadError": "canvas_ls.engine.errors",
    "SettingsError": "canvas_ls.engine.settings",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
