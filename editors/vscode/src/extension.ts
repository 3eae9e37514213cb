import * as readline from "node:readline";
import * as vscode from "vscode";
import {
  LanguageClient,
  LanguageClientOptions,
  ServerOptions,
  TransportKind,
  WorkspaceEdit as LspWorkspaceEdit,
} from "vscode-languageclient/node";
import {
  CanvasSettings,
  DEFAULT_SETTINGS,
  FillRegionsParams,
  FillRegionsResult,
  fillHolesParams,
  fillMessage,
  initializationOptions,
  Status,
  LearnResult,
  learnMessage,
  learnParams,
  LogLevel,
  doctorCommand,
  statusLines,
  statusNote,
  rewriteParams,
  serverCommand,
  serverLogLine,
} from "./config";
import { NextEdit, NextEditResult, nextEditLabel, nextEditMessage, nextEditParams, nextEditStep } from "./nextEdit";

let client: LanguageClient | undefined;
let enabled = true;
let lastLatencyMs: number | undefined;
let status: vscode.StatusBarItem;
let output: vscode.LogOutputChannel;

function readSettings(): CanvasSettings {
  const c = vscode.workspace.getConfiguration("canvasLs");
  return {
    command: c.get("command", DEFAULT_SETTINGS.command),
    pythonPath: c.get("pythonPath", DEFAULT_SETTINGS.pythonPath),
    model: c.get("model", DEFAULT_SETTINGS.model),
    device: c.get("device", DEFAULT_SETTINGS.device),
    quantize: c.get("quantize", DEFAULT_SETTINGS.quantize),
    backend: c.get("backend", DEFAULT_SETTINGS.backend),
    engineUrl: c.get("engineUrl", DEFAULT_SETTINGS.engineUrl),
    enabledLanguages: c.get("enabledLanguages", DEFAULT_SETTINGS.enabledLanguages),
    gapTokens: c.get("gapTokens", DEFAULT_SETTINGS.gapTokens),
    maxNewTokens: c.get("maxNewTokens", DEFAULT_SETTINGS.maxNewTokens),
    rewriteStrength: c.get("rewriteStrength", DEFAULT_SETTINGS.rewriteStrength),
    minConfidence: c.get("minConfidence", DEFAULT_SETTINGS.minConfidence),
    workspaceModels: c.get("workspaceModels", DEFAULT_SETTINGS.workspaceModels),
    learnMinutes: c.get("learnMinutes", DEFAULT_SETTINGS.learnMinutes),
  };
}

function showStatus(state: string, note?: { short: string; long: string }): void {
  const icon = !enabled ? "$(circle-slash)" : state === "ready" ? "$(check)" : state === "failed" ? "$(error)" : "$(sync~spin)";
  const latency = lastLatencyMs === undefined ? "" : ` ${Math.round(lastLatencyMs)} ms`;
  const shown = note === undefined ? "" : ` · ${note.short}`;
  status.text = `${icon} canvas-ls${enabled ? latency + shown : ""}`;
  const why = note === undefined ? "" : `\nLast completion: ${note.long}`;
  status.tooltip = `canvas-ls: engine ${state}${enabled ? "" : " (inline completion off)"}.${why}\nClick for the log.`;
}

// After a request that showed nothing (or a cut answer), the server's reason, in the status bar.
async function explain(running: LanguageClient): Promise<void> {
  try {
    const status = await running.sendRequest<Status>("canvas/status", {});
    showStatus(status.engine.state, statusNote(status.last[0]));
  } catch {
    // the server went away: the client reports that itself
  }
}

async function pollEngine(): Promise<void> {
  for (let i = 0; i < 600 && client; i++) {
    try {
      const stats = await client.sendRequest<{ engine: { state: string } }>("canvas/stats", {});
      showStatus(stats.engine.state);
      if (stats.engine.state === "ready" || stats.engine.state === "failed") return;
    } catch {
      showStatus("starting");
    }
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}

function eachLine(input: NodeJS.ReadableStream, handle: (line: string) => void): void {
  readline.createInterface({ input, crlfDelay: Infinity, terminal: false }).on("line", handle);
}

async function start(): Promise<void> {
  const settings = readSettings();
  const { command, args } = serverCommand(settings);
  const serverOptions: ServerOptions = { command, args, transport: TransportKind.stdio };
  const clientOptions: LanguageClientOptions = {
    documentSelector: settings.enabledLanguages.map((language) => ({ language })),
    initializationOptions: initializationOptions(settings),
    outputChannel: output,
    traceOutputChannel: output,
    // The server's log lines at their own level (the client's default shows all of stderr as errors).
    stdioOptions: {
      stdout: (input, channel) => eachLine(input, (line) => channel.info(line)),
      stderr: (input, channel) => {
        let level: LogLevel = "info";
        eachLine(input, (line) => {
          const parsed = serverLogLine(line, level);
          level = parsed.level;
          channel[level](parsed.text);
        });
      },
    },
    middleware: {
      provideInlineCompletionItems: async (document, position, context, token, next) => {
        if (!enabled) return undefined;
        const started = Date.now();
        const result = await next(document, position, context, token);
        lastLatencyMs = Date.now() - started;
        showStatus("ready");
        if (client) void explain(client);
        return result;
      },
    },
  };
  client = new LanguageClient("canvasLs", "canvas-ls", serverOptions, clientOptions);
  showStatus("starting");
  await client.start();
  void pollEngine();
}

// Several regions in one request, with a progress notification the user can cancel (the request is cancelled,
// and the engine stops denoising at its next step). The edit comes back for the version the fill read: VS Code
// refuses it if the document changed since, and applies it as one undo step.
async function fill(title: string, params: (editor: vscode.TextEditor) => FillRegionsParams): Promise<void> {
  const editor = vscode.window.activeTextEditor;
  const running = client;
  if (!editor || !running) {
    void vscode.window.showErrorMessage("canvas-ls: no editor, or the language server is not running");
    return;
  }
  const result = await vscode.window.withProgress(
    { location: vscode.ProgressLocation.Notification, title, cancellable: true },
    async (_progress, token) => {
      try {
        return await running.sendRequest<FillRegionsResult>("canvas/fillRegions", params(editor), token);
      } catch (error) {
        if (token.isCancellationRequested) return undefined;
        throw error;
      }
    },
  );
  if (!result) return; // cancelled by the user: nothing applied, nothing to say
  if (result.edit) {
    const edit = await running.protocol2CodeConverter.asWorkspaceEdit(result.edit as LspWorkspaceEdit);
    if (!(await vscode.workspace.applyEdit(edit))) {
      void vscode.window.showWarningMessage("canvas-ls: the document changed while the fill ran; nothing applied");
      return;
    }
  }
  const { level, text } = fillMessage(result);
  if (level === "error") void vscode.window.showErrorMessage(text);
  else if (level === "warning") void vscode.window.showWarningMessage(text);
  else void vscode.window.setStatusBarMessage(text, 5000);
}

// Tune the model on this workspace folder (the one of the active editor, else the only one, else the user picks).
async function learnWorkspace(): Promise<void> {
  const running = client;
  if (!running) {
    void vscode.window.showErrorMessage("canvas-ls: the language server is not running");
    return;
  }
  const active = vscode.window.activeTextEditor?.document.uri;
  const folders = vscode.workspace.workspaceFolders ?? [];
  const folder = (active && vscode.workspace.getWorkspaceFolder(active)) ??
    (folders.length === 1 ? folders[0] : await vscode.window.showWorkspaceFolderPick({ placeHolder: "Folder to learn" }));
  if (!folder) {
    if (!folders.length) void vscode.window.showErrorMessage("canvas-ls: open a folder to learn it");
    return;
  }
  const result = await running.sendRequest<LearnResult>("workspace/executeCommand", learnParams(folder.uri.toString()));
  const { level, text } = learnMessage(result ?? { error: "no answer from the server" });
  if (level === "error") void vscode.window.showErrorMessage(text);
  else void vscode.window.showInformationMessage(text);
}

// Next edits: the server's suggestions after the user's recent edits, shown where they apply (the replaced text
// struck through, the new text after it), the first one current. One key asks, jumps, accepts; any change to a
// document they are shown in drops them (they were computed for the text as it was).
let nextEdits: NextEdit[] = [];
const removed = vscode.window.createTextEditorDecorationType({
  textDecoration: "line-through",
  backgroundColor: new vscode.ThemeColor("diffEditor.removedTextBackground"),
});
const added = vscode.window.createTextEditorDecorationType({
  after: { backgroundColor: new vscode.ThemeColor("diffEditor.insertedTextBackground"), margin: "0 0 0 2px" },
});

function asRange(edit: NextEdit): vscode.Range {
  const { start, end } = edit.range;
  return new vscode.Range(start.line, start.character, end.line, end.character);
}

function showNextEdits(): void {
  for (const editor of vscode.window.visibleTextEditors) {
    const mine = nextEdits.filter((edit) => edit.textDocument.uri === editor.document.uri.toString());
    editor.setDecorations(removed, mine.map(asRange));
    editor.setDecorations(added, mine.map((edit) => ({
      range: new vscode.Range(asRange(edit).end, asRange(edit).end), // empty, at its end: the new text after it
      renderOptions: { after: { contentText: nextEditLabel(edit) } },
      hoverMessage: `canvas-ls next edit (${edit.predictor}, confidence ${edit.confidence})`,
    })));
  }
  void vscode.commands.executeCommand("setContext", "canvasLs.nextEditShown", nextEdits.length > 0);
}

function clearNextEdits(): void {
  nextEdits = [];
  showNextEdits();
}

async function nextEdit(): Promise<void> {
  const editor = vscode.window.activeTextEditor;
  const running = client;
  if (!editor || !running) {
    void vscode.window.showErrorMessage("canvas-ls: no editor, or the language server is not running");
    return;
  }
  const current = nextEdits[0];
  const step = nextEditStep(current, editor.document.uri.toString(), editor.selection.active.line);
  if (step === "jump") {
    const target = await vscode.window.showTextDocument(vscode.Uri.parse(current.textDocument.uri));
    const at = asRange(current).start;
    target.selection = new vscode.Selection(at, at);
    target.revealRange(asRange(current), vscode.TextEditorRevealType.InCenterIfOutsideViewport);
    return;
  }
  if (step === "accept") {
    clearNextEdits();
    const edit = new vscode.WorkspaceEdit();
    edit.replace(vscode.Uri.parse(current.textDocument.uri), asRange(current), current.newText);
    if (!(await vscode.workspace.applyEdit(edit))) return;
    // the accepted edit is now the last one: the server's answer for the text as it is holds the rest
  }
  const document = editor.document;
  const version = document.version;
  const params = nextEditParams(document.uri.toString(), version, editor.selection.active);
  const result = await running.sendRequest<NextEditResult>("canvas/nextEdit", params);
  if (document.version !== version) return; // the user typed meanwhile: the answer is for text that is gone
  nextEdits = result.edits;
  showNextEdits();
  void vscode.window.setStatusBarMessage(nextEditMessage(result), 5000);
}

async function stop(): Promise<void> {
  const running = client;
  client = undefined;
  if (running) await running.stop();
}

export async function activate(context: vscode.ExtensionContext): Promise<void> {
  output = vscode.window.createOutputChannel("canvas-ls", { log: true });
  status = vscode.window.createStatusBarItem(vscode.StatusBarAlignment.Right, 100);
  status.command = "canvasLs.showLog";
  status.show();
  context.subscriptions.push(
    output,
    status,
    vscode.commands.registerCommand("canvasLs.toggle", () => {
      enabled = !enabled;
      showStatus("ready");
    }),
    vscode.commands.registerCommand("canvasLs.restart", async () => {
      await stop();
      await start();
    }),
    vscode.commands.registerCommand("canvasLs.showLog", async () => {
      if (client) {
        try {
          const last = statusLines(await client.sendRequest<Status>("canvas/status", {}));
          output.appendLine(last.length ? "[canvas-ls] the last requests, newest first:" : "[canvas-ls] no request yet");
          for (const line of last) output.appendLine(line);
        } catch {
          // the server went away: the client reports that itself
        }
      }
      const doctor = doctorCommand(readSettings());
      output.appendLine(`[canvas-ls] nothing appears? In a terminal, \`${doctor}\` checks the installation and prints a fix for each problem.`);
      output.show(true);
    }),
    vscode.commands.registerCommand("canvasLs.fillHoles", () =>
      fill("canvas-ls: filling holes", (editor) =>
        fillHolesParams(editor.document.uri.toString(), editor.selection.active),
      ),
    ),
    vscode.commands.registerCommand("canvasLs.rewriteSelection", () =>
      fill("canvas-ls: rewriting the selection", (editor) =>
        rewriteParams(editor.document.uri.toString(), editor.selection, readSettings().rewriteStrength),
      ),
    ),
    vscode.commands.registerCommand("canvasLs.learnWorkspace", learnWorkspace),
    vscode.commands.registerCommand("canvasLs.nextEdit", nextEdit),
    vscode.commands.registerCommand("canvasLs.nextEditClear", clearNextEdits),
    removed,
    added,
    vscode.workspace.onDidChangeTextDocument((event) => {
      const uri = event.document.uri.toString();
      if (event.contentChanges.length && nextEdits.some((edit) => edit.textDocument.uri === uri)) clearNextEdits();
    }),
    vscode.window.onDidChangeVisibleTextEditors(showNextEdits),
    vscode.workspace.onDidChangeConfiguration(async (event) => {
      if (event.affectsConfiguration("canvasLs")) {
        await stop();
        await start();
      }
    }),
  );
  await start();
}

export async function deactivate(): Promise<void> {
  await stop();
}
