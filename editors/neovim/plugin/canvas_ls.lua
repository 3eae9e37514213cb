vim.api.nvim_create_user_command('CanvasLsStats', function()
  print(vim.inspect(require('canvas_ls').stats()))
end, { desc = 'canvas-ls: engine state and request counters' })
