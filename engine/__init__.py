"""canvas-ls engine: fills a gap in code by denoising a canvas with a DiffusionGemma-architecture model.

Public names (everything else is internal):
  Engine, InfillResult, InfillCancelled -- text in, result out (engine.engine)
  InfillSettings, SettingsError         -- the knobs (engine.settings)
  ModelLoadError, DEFAULT_MODEL_DIR     -- loading (engine.loading)
"""

from engine.canvas import InfillCancelled
from engine.engine import Engine, InfillResult
from engine.loading import DEFAULT_MODEL_DIR, ModelLoadError
from engine.settings import InfillSettings, SettingsError

__all__ = [
    "DEFAULT_MODEL_DIR",
    "Engine",
    "InfillCancelled",
    "InfillResult",
    "InfillSettings",
    "ModelLoadError",
    "SettingsError",
]
