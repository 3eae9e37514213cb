"""canvas-ls front end: the command line and (later) the language server. Never touches a tensor."""
