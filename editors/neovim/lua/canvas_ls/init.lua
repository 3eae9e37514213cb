-- A small plugin around the canvas-ls server: enable it, turn on inline completion (Neovim 0.12) for the
-- buffers it attaches to, and map a key that accepts the suggestion (falling back to the key itself). On Neovim 0.11
-- the suggestion comes as an item of the LSP completion menu (vim.lsp.completion).
local M = {}

---@class canvas_ls.Opts
---@field accept_key? string  insert-mode key that accepts the inline suggestion (default '<Tab>')
---@field config? vim.lsp.Config  merged into lsp/canvas_ls.lua (cmd, init_options, filetypes...)
---@field menu_autotrigger? boolean  Neovim 0.11 (no inline completion): open the completion menu with the
---  suggestion as you type (default true); false: only on <C-x><C-o> or vim.lsp.completion.get()
---@field prefetch? boolean  Neovim 0.12: tell the server where the cursor went in insert mode, so that it starts
---  the suggestion there while Neovim's inline completion waits out its fixed 200 ms debounce (default true)
---@field show_early? boolean  Neovim 0.12, with prefetch: show the suggestion as soon as the server has it for the
---  place where the cursor still is, instead of when Neovim's debounce ends (default true)
---@field next_edit_key? string  normal-mode key for next edits: ask for them, then jump to the shown one, then
---  accept it (default: none; :CanvasLsNextEdit does the same)
---@field accept_word_key? string  insert-mode key that accepts the suggestion's next word and keeps the rest shown
---  (default '<C-Right>', as VS Code's; falls back to the key itself; false: none)
---@field accept_line_key? string  insert-mode key that accepts the rest of the suggestion's current line (default
---  '<C-Down>'; falls back to the key itself; false: none)
---@field invoke_key? string  insert-mode key that asks for a suggestion here and now (an Invoked request: shown
---  whatever the model's confidence; when nothing comes, the server says why) (default '<M-\>', as VS Code's Alt+\;
---  false: none)

---@param opts? canvas_ls.Opts
function M.setup(opts)
  opts = opts or {}
  if opts.config then
    vim.lsp.config('canvas_ls', opts.config)
  end
  vim.lsp.enable('canvas_ls')
  vim.api.nvim_create_user_command('CanvasLsFill', function()
    M.fill_holes()
  end, { desc = 'canvas-ls: fill the holes of the function or class at the cursor' })
  vim.api.nvim_create_user_command('CanvasLsRewrite', function(command)
    M.rewrite(command.line1, command.line2)
  end, { range = true, desc = 'canvas-ls: rewrite the selected lines (or the last visual selection) in place' })
  vim.api.nvim_create_user_command('CanvasLsNextEdit', function()
    M.next_edit()
  end, { desc = 'canvas-ls: suggest the next edits; again: jump to the shown one, then accept it' })
  vim.api.nvim_create_user_command('CanvasLsNextEditClear', function()
    M.next_edit_clear()
  end, { desc = 'canvas-ls: drop the shown next-edit suggestions' })
  if opts.next_edit_key then
    vim.keymap.set('n', opts.next_edit_key, M.next_edit, { desc = 'canvas-ls: next edit: ask, jump, accept' })
  end
  vim.api.nvim_create_user_command('CanvasLsStatus', function()
    print(M.status_text())
  end, { desc = 'canvas-ls: the engine, the last requests and why nothing was shown' })
  vim.api.nvim_create_autocmd('LspRequest', {
    group = vim.api.nvim_create_augroup('canvas_ls_status', { clear = true }),
    callback = function(args)
      local req = args.data.request
      if req and req.type == 'complete' and req.method == 'textDocument/inlineCompletion' then
        M.refresh_status(args.buf)
      end
    end,
  })
  vim.api.nvim_create_user_command('CanvasLsLearnWorkspace', function(command)
    M.learn_workspace(command.args ~= '' and command.args or nil)
  end, { nargs = '?', complete = 'dir', desc = 'canvas-ls: learn this workspace (tune the model on its code)' })

  local inline = vim.lsp.inline_completion ~= nil -- Neovim 0.12+
  vim.api.nvim_create_autocmd('LspAttach', {
    group = vim.api.nvim_create_augroup('canvas_ls', { clear = true }),
    callback = function(args)
      local client = vim.lsp.get_client_by_id(args.data.client_id)
      if not client or client.name ~= 'canvas_ls' then
        return
      end
      if inline then
        vim.lsp.inline_completion.enable(true, { bufnr = args.buf })
        if opts.prefetch ~= false then
          vim.api.nvim_create_autocmd({ 'InsertEnter', 'CursorMovedI' }, {
            group = vim.api.nvim_create_augroup('canvas_ls_prefetch_' .. args.buf, { clear = true }),
            buffer = args.buf,
            callback = function()
              M.prefetch(args.buf, opts.show_early ~= false)
            end,
          })
        end
      else -- 0.11: the suggestion is one item of the completion menu (<C-y> inserts it)
        vim.lsp.completion.enable(true, client.id, args.buf, { autotrigger = opts.menu_autotrigger ~= false })
      end
    end,
  })
  if not inline then
    return
  end
  local key = opts.accept_key or '<Tab>'
  vim.keymap.set('i', key, function()
    if not vim.lsp.inline_completion.get() then
      return key
    end
  end, { expr = true, replace_keycodes = true, desc = 'canvas-ls: accept the inline completion' })
  for unit, default in pairs({ word = '<C-Right>', line = '<C-Down>' }) do
    local partial_key = opts['accept_' .. unit .. '_key']
    if partial_key ~= false then
      partial_key = partial_key or default
      vim.keymap.set('i', partial_key, function()
        if not M.accept_part(unit) then
          return partial_key
        end
      end, { expr = true, replace_keycodes = true, desc = 'canvas-ls: accept the next ' .. unit .. ' of the suggestion' })
    end
  end
  if opts.invoke_key ~= false then
    vim.keymap.set('i', opts.invoke_key or '<M-\\>', function()
      M.invoke()
    end, { desc = 'canvas-ls: ask for a suggestion here (says why when none comes)' })
  end
end

-- The canvas-ls client of `bufnr`; when there is none, nil (and an error message unless `quiet`).
local function client_for(bufnr, quiet)
  local client = vim.lsp.get_clients({ name = 'canvas_ls', bufnr = bufnr })[1]
  if not client and not quiet then
    vim.notify('canvas-ls: not attached to this buffer', vim.log.levels.ERROR)
  end
  return client
end

-- Position params for the cursor in `bufnr`, naming the buffer's version (the server answers a request for another
-- version at once, as stale), and that version.
local function versioned_params(client, bufnr)
  local params = vim.lsp.util.make_position_params(0, client.offset_encoding)
  local version = vim.lsp.util.buf_versions[bufnr]
  params.textDocument.version = version
  return params, version
end

-- The server fills, then sends the edit as workspace/applyEdit (one undo step) and says in a message which regions
-- stayed as they were, and why. `on_done(result)` gets its summary (tests, statuslines).
local function execute(client, bufnr, command, argument, on_done)
  M.last_fill = nil
  client:request('workspace/executeCommand', { command = command, arguments = { argument } }, function(err, result)
    if err then
      vim.notify('canvas-ls: ' .. (err.message or tostring(err)), vim.log.levels.ERROR)
    elseif result and not result.error and not result.stale then
      vim.notify('canvas-ls: ' .. result.message, vim.log.levels.INFO)
    end
    M.last_fill = err and { error = err.message } or result
    if on_done then
      on_done(M.last_fill)
    end
  end, bufnr)
end

--- Fill the placeholders (`...`, `pass  # TODO`, `todo!()`, TODO comments, empty bodies) of the function or class
--- at the cursor, in one request.
function M.fill_holes(bufnr, on_done)
  bufnr = bufnr or vim.api.nvim_get_current_buf()
  local client = client_for(bufnr)
  if not client then
    return
  end
  local position = vim.lsp.util.make_position_params(0, client.offset_encoding).position
  local argument = { textDocument = { uri = vim.uri_from_bufnr(bufnr) }, position = position }
  execute(client, bufnr, 'canvas-ls.fillHoles', argument, on_done)
end

--- Rewrite lines first..last (1-based, whole lines) in place, starting from their current text.
function M.rewrite(first, last, bufnr, on_done)
  bufnr = bufnr or vim.api.nvim_get_current_buf()
  local client = client_for(bufnr)
  if not client then
    return
  end
  local last_text = vim.api.nvim_buf_get_lines(bufnr, last - 1, last, true)[1]
  local last_column = vim.lsp.util.character_offset(bufnr, last - 1, #last_text, client.offset_encoding)
  local range = { start = { line = first - 1, character = 0 }, ['end'] = { line = last - 1, character = last_column } }
  local argument = { textDocument = { uri = vim.uri_from_bufnr(bufnr) }, range = range }
  execute(client, bufnr, 'canvas-ls.rewriteSelection', argument, on_done)
end

--- Tune the model on the repository of `folder` (default: the client's workspace folder, else the current
--- directory) in the background: the server reports progress ($/progress, shown by Neovim's LSP progress UI) and says
--- when the repository's files use the new model. `on_done(result)` gets {workspace, minutes} or {error}.
function M.learn_workspace(folder, bufnr, on_done)
  bufnr = bufnr or vim.api.nvim_get_current_buf()
  local client = client_for(bufnr)
  if not client then
    return
  end
  local root = folder and vim.fn.fnamemodify(folder, ':p')
    or (client.workspace_folders and client.workspace_folders[1] and vim.uri_to_fname(client.workspace_folders[1].uri))
    or vim.fn.getcwd()
  local params = { command = 'canvas-ls.learnWorkspace', arguments = { { folder = vim.uri_from_fname(root) } } }
  client:request('workspace/executeCommand', params, function(err, result)
    local outcome = err and { error = err.message } or result or { error = 'no answer from the server' }
    if outcome.error then
      vim.notify('canvas-ls: ' .. outcome.error, vim.log.levels.ERROR)
    else
      vim.notify(('canvas-ls: learning %s for %s min in the background'):format(outcome.workspace, outcome.minutes))
    end
    if on_done then
      on_done(outcome)
    end
  end, bufnr)
end

-- Ask Neovim's inline completion for the suggestion now rather than when its debounce ends, if the cursor is still
-- where the server computed it (same buffer, version and place, insert mode) and the debounce is still running.
-- Neovim 0.12 has no public call for this: its per-buffer inline-completion object is reached through
-- vim.lsp._capability, and where that is not as expected (another Neovim) nothing happens: the debounce asks.
-- Neovim 0.12's per-buffer inline-completion object (reached through vim.lsp._capability: no public call asks it
-- for a suggestion), or nil where that is not as expected.
local function completor_of(bufnr)
  local ok, capability = pcall(require, 'vim.lsp._capability')
  local kind = ok and type(capability.all) == 'table' and capability.all.inline_completion
  return kind and kind.active and kind.active[bufnr]
end

local function show_now(client, bufnr, version, position)
  if
    vim.api.nvim_get_current_buf() ~= bufnr
    or not vim.api.nvim_get_mode().mode:match('^i')
    or vim.lsp.util.buf_versions[bufnr] ~= version
  then
    return false
  end
  local here = vim.lsp.util.make_position_params(0, client.offset_encoding).position
  if here.line ~= position.line or here.character ~= position.character then
    return false
  end
  local completor = completor_of(bufnr)
  local timer = completor and completor.timer
  if not (timer and not timer:is_closing() and completor.reset_timer and completor.request) then
    return false -- Neovim has asked already (or nothing is pending)
  end
  completor:reset_timer()
  completor:request(vim.lsp.protocol.InlineCompletionTriggerKind.Automatic)
  M.shown_early = M.shown_early + 1
  return true
end

--- Ask for a suggestion at the cursor now, as the user's own request (trigger kind Invoked): the model's answer is
--- shown whatever its confidence, and when nothing can be shown the server says why (a message). Neovim 0.12's
--- inline completion has no public call for this; its per-buffer object is reached as in `show_now`.
function M.invoke(bufnr)
  bufnr = bufnr or vim.api.nvim_get_current_buf()
  if not client_for(bufnr) then
    return false
  end
  local completor = completor_of(bufnr)
  if not (completor and completor.request) then
    vim.notify('canvas-ls: asking for a suggestion needs Neovim 0.12 inline completion in this buffer',
      vim.log.levels.WARN)
    return false
  end
  if completor.reset_timer then
    completor:reset_timer()
  end
  completor:request(vim.lsp.protocol.InlineCompletionTriggerKind.Invoked)
  return true
end

--- The start of a suggestion's `text` that a partial accept of `unit` takes: 'word', the next word (the spaces
--- before it included) or run of punctuation, or a line break with the next line's indentation; 'line', the rest of
--- the current line (after a line break: the next line).
function M.part(text, unit)
  if unit == 'line' then
    return text:match('^\n?[^\n]*')
  end
  return text:match('^\n[ \t]*') or text:match('^[ \t]*[%w_]+') or text:match('^[ \t]*[^%w_%s]+') or text
end

--- Accept the next `unit` ('word' or 'line', `M.part`) of the suggestion shown in the current buffer: it is inserted
--- at the cursor, the server is told how many characters were taken (its statistics), and the rest is shown again
--- (the server answers it from what it had: the suggestion being typed through). A suggestion that replaces text
--- (a non-empty range) is accepted whole. False when none is shown (a mapping then falls back to its key).
function M.accept_part(unit)
  local bufnr = vim.api.nvim_get_current_buf()
  return vim.lsp.inline_completion.get({
    bufnr = bufnr,
    on_accept = function(item)
      local text = type(item.insert_text) == 'string' and item.insert_text or nil
      local range = item.range
      local empty = not range or (range.start.row == range.end_.row and range.start.col == range.end_.col)
      local completor = completor_of(bufnr)
      if not (text and empty and completor and completor.accept) then
        if completor and completor.accept then
          completor:accept(item)
        end
        return
      end
      local head = M.part(text, unit)
      local lines = vim.split(head, '\n')
      local row, col = unpack(vim.api.nvim_win_get_cursor(0))
      if range then
        row, col = range.start.row + 1, range.start.col
      end
      vim.api.nvim_buf_set_text(bufnr, row - 1, col, row - 1, col, lines)
      vim.api.nvim_win_set_cursor(0, { row + #lines - 1, (#lines == 1 and col or 0) + #lines[#lines] })
      local command = item.command
      if command and #head < #text then -- the statistics: this many characters of it
        command = vim.deepcopy(command)
        command.arguments = { command.arguments[1], vim.fn.strchars(head) }
      end
      if command then
        vim.lsp.get_client_by_id(item.client_id):exec_cmd(command, { bufnr = bufnr })
      end
    end,
  })
end

--- How many suggestions were asked for as soon as the server had them (not after Neovim's debounce).
M.shown_early = 0

--- Tell the server the cursor's place in `bufnr` (default: current), where Neovim will ask for a suggestion once
--- its debounce ends: the server starts computing it now. A request, so that pending changes go out first. With
--- `show_early`, the server answers once the suggestion is computed, and Neovim is asked for it at once if the
--- cursor is still there.
function M.prefetch(bufnr, show_early)
  bufnr = bufnr or vim.api.nvim_get_current_buf()
  local client = client_for(bufnr, true)
  if not client then
    return
  end
  local params, version = versioned_params(client, bufnr)
  params.wait = show_early or nil
  client:request('canvas/prefetch', params, function(err, result)
    if show_early and not err and result and result.ready then
      show_now(client, bufnr, version, params.position)
    end
  end, bufnr)
end

-- Next edits (`canvas/nextEdit`): the suggestions after the user's recent edits, each shown where it applies (the
-- text it replaces struck through, the new text as virtual text after it), the first one current. Any change to a
-- buffer they are shown in drops them (they were computed for the text as it was).
local next_ns = vim.api.nvim_create_namespace('canvas_ls_next_edit')

-- The byte column of an LSP position in `bufnr`.
local function byte_column(bufnr, position, encoding)
  local line = vim.api.nvim_buf_get_lines(bufnr, position.line, position.line + 1, false)[1] or ''
  return vim.str_byteindex(line, encoding, position.character, false)
end

--- The shown suggestions, nearest first (the first is the one the key jumps to and accepts): { {bufnr, range,
--- newText, encoding} } or nil.
M.next_edits = nil

local function next_edit_show()
  for number, item in ipairs(M.next_edits or {}) do
    local first, last = item.range.start, item.range['end']
    local current = number == 1
    local start_col = byte_column(item.bufnr, first, item.encoding)
    local end_col = byte_column(item.bufnr, last, item.encoding)
    local lines = vim.split(item.newText, '\n', { plain = true })
    if last.line > first.line or end_col > start_col then -- the text it replaces, struck through
      vim.api.nvim_buf_set_extmark(item.bufnr, next_ns, first.line, start_col, {
        end_row = last.line, end_col = end_col, hl_group = current and 'DiffDelete' or 'Comment',
      })
    end
    vim.api.nvim_buf_set_extmark(item.bufnr, next_ns, last.line, end_col, { -- the new text right after it
      virt_text = { { lines[1] .. (#lines > 1 and ' …' or ''), current and 'DiffAdd' or 'Comment' } },
      virt_text_pos = 'inline',
    })
  end
end

--- Drop the shown next-edit suggestions.
function M.next_edit_clear()
  for _, item in ipairs(M.next_edits or {}) do
    if vim.api.nvim_buf_is_valid(item.bufnr) then
      vim.api.nvim_buf_clear_namespace(item.bufnr, next_ns, 0, -1)
    end
  end
  M.next_edits = nil
end

-- Apply the current suggestion, then ask again: the accepted edit is now the last one, and the server's answer
-- for the text as it is holds the rest (the ranges it gave before were for the text it read).
local function next_edit_accept(item)
  M.next_edit_clear()
  vim.lsp.util.apply_text_edits({ { range = item.range, newText = item.newText } }, item.bufnr, item.encoding)
  M.next_edit(item.bufnr)
end

--- Next edits, one key for all: with none shown, ask the server (at the cursor, for the buffer's version) and show
--- what it suggests; with one shown away from the cursor, jump to it; at it, accept it. `on_done(result)` gets the
--- server's answer (tests, statuslines).
function M.next_edit(bufnr, on_done)
  bufnr = (bufnr == nil or bufnr == 0) and vim.api.nvim_get_current_buf() or bufnr
  local item = M.next_edits and M.next_edits[1]
  if item then
    local cursor = vim.api.nvim_win_get_cursor(0)
    local row = item.range.start.line
    local col = byte_column(item.bufnr, item.range.start, item.encoding)
    if vim.api.nvim_get_current_buf() == item.bufnr and cursor[1] - 1 == row then
      next_edit_accept(item)
    else
      vim.api.nvim_set_current_buf(item.bufnr)
      vim.api.nvim_win_set_cursor(0, { row + 1, col })
    end
    return
  end
  local client = client_for(bufnr)
  if not client then
    return
  end
  local params, version = versioned_params(client, bufnr)
  client:request('canvas/nextEdit', params, function(err, result)
    M.next_edit_result = err and { error = err.message } or result
    if err then
      vim.notify('canvas-ls: ' .. (err.message or tostring(err)), vim.log.levels.ERROR)
    elseif vim.lsp.util.buf_versions[bufnr] ~= version then
      M.next_edit_result = { edits = {}, reason = 'the buffer changed while the suggestion was computed' }
    elseif #result.edits == 0 then
      vim.notify('canvas-ls: no next edit: ' .. (result.reason or 'nothing to change'), vim.log.levels.INFO)
    else
      M.next_edit_clear()
      local items = {}
      for _, edit in ipairs(result.edits) do
        local target = vim.uri_to_bufnr(edit.textDocument.uri)
        vim.fn.bufload(target)
        table.insert(items, { bufnr = target, range = edit.range, newText = edit.newText,
                              encoding = client.offset_encoding })
      end
      M.next_edits = items
      next_edit_show()
      for _, item in ipairs(items) do
        local tick = vim.api.nvim_buf_get_changedtick(item.bufnr)
        vim.api.nvim_create_autocmd({ 'TextChanged', 'TextChangedI' }, {
          group = vim.api.nvim_create_augroup('canvas_ls_next_edit_' .. item.bufnr, { clear = true }),
          buffer = item.bufnr,
          callback = function()
            if M.next_edits ~= items then
              return true -- other suggestions are shown now: this watch ends
            end
            if vim.api.nvim_buf_get_changedtick(item.bufnr) ~= tick then
              M.next_edit_clear() -- the text they were computed for changed
              return true
            end
          end,
        })
      end
    end
    if on_done then
      on_done(M.next_edit_result)
    end
  end, bufnr)
end

--- The last `canvas/status` this buffer's server answered (refreshed after each inline completion request).
M.last_status = nil

-- A JSON value as Lua reads it: null (vim.NIL) as nil.
local function value(x)
  if x == vim.NIL then
    return nil
  end
  return x
end

--- Ask the server for its status in the background (the statusline reads the answer when it comes).
function M.refresh_status(bufnr)
  local client = client_for(bufnr or 0, true)
  if not client then
    return
  end
  client:request('canvas/status', {}, function(err, result)
    if not err and result then
      M.last_status = result
      vim.cmd.redrawstatus()
    end
  end, bufnr or 0)
end

--- For the statusline (never waits on the server): "canvas-ls" and the engine's state or the last request's
--- outcome: the reason it showed nothing, e.g. "canvas-ls: low confidence". An unknown reason shows as its text.
function M.statusline()
  local status = M.last_status
  if not status then
    return ''
  end
  if status.engine.state ~= 'ready' then
    return 'canvas-ls: ' .. status.engine.state
  end
  local last = status.last and status.last[1]
  if not last then
    return 'canvas-ls'
  end
  return last.shown and 'canvas-ls: shown' or ('canvas-ls: ' .. (value(last.why) or 'nothing shown'))
end

--- :CanvasLsStatus: the engine, how many requests showed a suggestion, per reason how many did not, and the last
--- requests with their reasons in words (the server's `canvas/status`, asked now).
function M.status_text(bufnr)
  local client = client_for(bufnr or 0, true)
  if not client then
    return 'canvas-ls: no canvas-ls server in this buffer'
  end
  local response = client:request_sync('canvas/status', {}, 2000, bufnr or 0)
  local status = response and response.result
  if not status then
    return 'canvas-ls: the server did not answer canvas/status'
  end
  M.last_status = status
  local engine = status.engine
  local lines = {
    string.format('canvas-ls: engine %s (%s)%s', engine.state, value(engine.model) or '?',
      value(engine.error) and (': ' .. engine.error) or ''),
    string.format('%d requests, %d showed a suggestion', status.requests, status.shown),
  }
  local words = {}
  for _, reason in ipairs(status.reasons) do
    words[reason.why] = reason.words
  end
  for _, silent in ipairs(status.silent) do
    table.insert(lines, string.format('  %4d nothing shown: %s', silent.count, words[silent.why] or silent.why))
  end
  for i = 1, math.min(5, #status.last) do
    local last = status.last[i]
    local why = value(last.why)
    local what = last.shown and 'shown' or (why and (words[why] or why) or 'nothing shown')
    table.insert(lines, string.format('last %d%s: %s%s (%.0f ms)', i, last.invoked and ' (asked)' or '', what,
      value(last.detail) and ('; ' .. last.detail) or '', last.ms))
  end
  return table.concat(lines, '\n')
end

--- The server's counters and engine state (`canvas/stats`), for :CanvasLsStats and tests.
function M.stats(bufnr)
  local client = client_for(bufnr or 0, true)
  if not client then
    return nil
  end
  local response = client:request_sync('canvas/stats', {}, 2000, bufnr or 0)
  return response and response.result
end

return M
