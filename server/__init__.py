"""canvas-ls front end: the language server (`lsp.py`: context, shaping, backends) and the command line (`cli.py`).
Never touches a tensor; the LSP process never imports torch (the model runs in the resident engine)."""
