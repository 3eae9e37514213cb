-- A small plugin around the canvas-ls server: enable it, turn on inline completion (Neovim 0.12) for the
-- buffers it attaches to, and map a key that accepts the suggestion (falling back to the key itself).
local M = {}

---@class canvas_ls.Opts
---@field accept_key? string  insert-mode key that accepts the inline suggestion (default '<Tab>')
---@field config? vim.lsp.Config  merged into lsp/canvas_ls.lua (cmd, init_options, filetypes...)

---@param opts? canvas_ls.Opts
function M.setup(opts)
  opts = opts or {}
  if opts.config then
    vim.lsp.config('canvas_ls', opts.config)
  end
  vim.lsp.enable('canvas_ls')

  if not vim.lsp.inline_completion then
    vim.notify('canvas-ls: inline completion needs Neovim 0.12; suggestions still come as completion items',
      vim.log.levels.WARN)
    return
  end
  vim.api.nvim_create_autocmd('LspAttach', {
    group = vim.api.nvim_create_augroup('canvas_ls', { clear = true }),
    callback = function(args)
      local client = vim.lsp.get_client_by_id(args.data.client_id)
      if client and client.name == 'canvas_ls' then
        vim.lsp.inline_completion.enable(true, { bufnr = args.buf })
      end
    end,
  })
  local key = opts.accept_key or '<Tab>'
  vim.keymap.set('i', key, function()
    if not vim.lsp.inline_completion.get() then
      return key
    end
  end, { expr = true, replace_keycodes = true, desc = 'canvas-ls: accept the inline completion' })
end

--- The server's counters and engine state (`canvas/stats`), for :CanvasLsStats and tests.
function M.stats(bufnr)
  local client = vim.lsp.get_clients({ name = 'canvas_ls', bufnr = bufnr or 0 })[1]
  if not client then
    return nil
  end
  local response = client:request_sync('canvas/stats', {}, 2000, bufnr or 0)
  return response and response.result
end

return M
