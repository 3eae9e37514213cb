-- canvas-ls for Neovim 0.11+ (`vim.lsp.config` / `vim.lsp.enable`). Inline completion needs 0.12.
-- Options go to the server as init_options; see the canvas-ls README for the whole list.
---@type vim.lsp.Config
return {
  cmd = { 'canvas-ls', 'serve' },
  filetypes = {
    'python', 'javascript', 'javascriptreact', 'typescript', 'typescriptreact',
    'go', 'rust', 'c', 'cpp', 'java', 'lua',
  },
  root_markers = { '.git', 'pyproject.toml', 'package.json', 'go.mod', 'Cargo.toml' },
  init_options = {
    -- model = '/path/to/model' to use another one than the shipped default; backend = 'local' to run the model
    -- inside this server instead of the shared `canvas-ls engine` (the default, 'resident'); quantize = 'int4' (or
    -- 'int8', 'none'; default 'auto': what fits the GPU) for DiffusionGemma on a 24 (48) GB card
    engine = { device = 'auto' },
  },
}
