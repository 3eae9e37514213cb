"""Errors the engine reports to its callers, importable without torch (the language server and the CLI catch them
before any model is loaded)."""


class ModelLoadError(RuntimeError):
    """The model could not be loaded; str(error) is one line meant for the user."""
