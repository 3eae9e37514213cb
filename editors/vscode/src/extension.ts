import * as vscode from "vscode";
import {
  LanguageClient,
  LanguageClientOptions,
  ServerOptions,
  TransportKind,
} from "vscode-languageclient/node";
import { CanvasSettings, DEFAULT_SETTINGS, initializationOptions, serverCommand } from "./config";

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
    backend: c.get("backend", DEFAULT_SETTINGS.backend),
    enabledLanguages: c.get("enabledLanguages", DEFAULT_SETTINGS.enabledLanguages),
    gapTokens: c.get("gapTokens", DEFAULT_SETTINGS.gapTokens),
  };
}

function showStatus(state: string): void {
  const icon = !enabled ? "$(circle-slash)" : state === "ready" ? "$(check)" : state === "failed" ? "$(error)" : "$(sync~spin)";
  const latency = lastLatencyMs === undefined ? "" : ` ${Math.round(lastLatencyMs)} ms`;
  status.text = `${icon} canvas-ls${enabled ? latency : ""}`;
  status.tooltip = `canvas-ls: engine ${state}${enabled ? "" : " (inline completion off)"}. Click to toggle.`;
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

async function start(): Promise<void> {
  const settings = readSettings();
  const { command, args } = serverCommand(settings);
  const serverOptions: ServerOptions = { command, args, transport: TransportKind.stdio };
  const clientOptions: LanguageClientOptions = {
    documentSelector: settings.enabledLanguages.map((language) => ({ language })),
    initializationOptions: initializationOptions(settings),
    outputChannel: output,
    traceOutputChannel: output,
    middleware: {
      provideInlineCompletionItems: async (document, position, context, token, next) => {
        if (!enabled) return undefined;
        const started = Date.now();
        const result = await next(document, position, context, token);
        lastLatencyMs = Date.now() - started;
        showStatus("ready");
        return result;
      },
    },
  };
  client = new LanguageClient("canvasLs", "canvas-ls", serverOptions, clientOptions);
  showStatus("starting");
  await client.start();
  void pollEngine();
}

async function stop(): Promise<void> {
  const running = client;
  client = undefined;
  if (running) await running.stop();
}

export async function activate(context: vscode.ExtensionContext): Promise<void> {
  output = vscode.window.createOutputChannel("canvas-ls", { log: true });
  status = vscode.window.createStatusBarItem(vscode.StatusBarAlignment.Right, 100);
  status.command = "canvasLs.toggle";
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
    vscode.commands.registerCommand("canvasLs.showLog", () => output.show(true)),
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
