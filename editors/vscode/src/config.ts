// What the extension hands the server: the command that starts it and the initializationOptions.
// No `vscode` import here, so the node tests build exactly what the extension builds.

export interface CanvasSettings {
  command: string[];
  pythonPath: string;
  model: string;
  device: string;
  backend: string;
  enabledLanguages: string[];
  gapTokens: { singleLine?: number; multiLine?: number };
}

export const DEFAULT_SETTINGS: CanvasSettings = {
  command: ["canvas-ls", "serve"],
  pythonPath: "",
  model: "",
  device: "auto",
  backend: "resident",
  enabledLanguages: [
    "python", "javascript", "javascriptreact", "typescript", "typescriptreact", "go", "rust", "c", "cpp", "java", "lua",
  ],
  gapTokens: { singleLine: 16, multiLine: 32 },
};

export interface ServerCommand {
  command: string;
  args: string[];
}

export function serverCommand(settings: CanvasSettings): ServerCommand {
  if (settings.pythonPath) {
    return { command: settings.pythonPath, args: ["-m", "server.cli", "serve"] };
  }
  const [command, ...args] = settings.command.length ? settings.command : DEFAULT_SETTINGS.command;
  return { command, args };
}

// The server's option tree (server/config.py): engine, completion, languages.
export function initializationOptions(settings: CanvasSettings): Record<string, unknown> {
  const completion: Record<string, number> = {};
  if (settings.gapTokens.singleLine) completion.gap_tokens_single_line = settings.gapTokens.singleLine;
  if (settings.gapTokens.multiLine) completion.gap_tokens_multi_line = settings.gapTokens.multiLine;
  return {
    engine: { model: settings.model || null, device: settings.device || "auto", backend: settings.backend || "resident" },
    completion,
  };
}
