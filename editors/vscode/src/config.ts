// What the extension hands the server: the command that starts it and the initializationOptions.
// No `vscode` import here, so the node tests build exactly what the extension builds.

export interface CanvasSettings {
  command: string[];
  pythonPath: string;
  model: string;
  device: string;
  quantize: string; // the model's weights: auto (what fits the GPU), none, int8, int4
  backend: string;
  engineUrl: string; // the remote backend's deployment (its token comes from $CANVAS_LS_TOKEN, never settings)
  enabledLanguages: string[];
  gapTokens: { singleLine?: number; multiLine?: number };
  maxNewTokens: { singleLine?: number; multiLine?: number };
  rewriteStrength: number;
  minConfidence: number | null; // null: the model's calibrated threshold; 0: show every answer
  workspaceModels: boolean; // a repository's files answered by the model tuned on it, when there is one
  learnMinutes: number | null; // "Learn this workspace": training minutes (null: the server's default)
}

export const DEFAULT_SETTINGS: CanvasSettings = {
  command: ["canvas-ls", "serve"],
  pythonPath: "",
  model: "",
  device: "auto",
  quantize: "auto",
  backend: "resident",
  engineUrl: "",
  enabledLanguages: [
    "python", "javascript", "javascriptreact", "typescript", "typescriptreact", "go", "rust", "c", "cpp", "java", "lua",
  ],
  gapTokens: { singleLine: 16, multiLine: 32 },
  maxNewTokens: { singleLine: 48, multiLine: 128 },
  rewriteStrength: 0.5,
  minConfidence: null,
  workspaceModels: true,
  learnMinutes: null,
};

export interface ServerCommand {
  command: string;
  args: string[];
}

export function serverCommand(settings: CanvasSettings): ServerCommand {
  if (settings.pythonPath) {
    return { command: settings.pythonPath, args: ["-m", "canvas_ls.server.cli", "serve"] };
  }
  const [command, ...args] = settings.command.length ? settings.command : DEFAULT_SETTINGS.command;
  return { command, args };
}

// The command that checks the installation: the server's own, `doctor` in place of `serve` and what follows it (its
// options: `--log-level debug` is not doctor's).
export function doctorCommand(settings: CanvasSettings): string {
  const { command, args } = serverCommand(settings);
  const serve = args.indexOf("serve");
  return [command, ...(serve >= 0 ? args.slice(0, serve) : args), "doctor"].join(" ");
}

// The server's option tree (server/config.py): engine, completion, languages.
export function initializationOptions(settings: CanvasSettings): Record<string, unknown> {
  const completion: Record<string, number | null> = {};
  if (settings.gapTokens.singleLine) completion.gap_tokens_single_line = settings.gapTokens.singleLine;
  if (settings.gapTokens.multiLine) completion.gap_tokens_multi_line = settings.gapTokens.multiLine;
  if (settings.maxNewTokens.singleLine) completion.max_new_tokens_single_line = settings.maxNewTokens.singleLine;
  if (settings.maxNewTokens.multiLine) completion.max_new_tokens_multi_line = settings.maxNewTokens.multiLine;
  if (typeof settings.minConfidence === "number") completion.min_confidence = settings.minConfidence;
  const engine: Record<string, unknown> = {
    model: settings.model || null,
    device: settings.device || "auto",
    quantize: settings.quantize || "auto",
    backend: settings.backend || "resident",
    workspace_models: settings.workspaceModels,
  };
  if (typeof settings.learnMinutes === "number" && settings.learnMinutes > 0) engine.learn_minutes = settings.learnMinutes;
  if (settings.engineUrl) engine.url = settings.engineUrl;
  return { engine, completion };
}

// "canvas-ls: Learn this workspace": the server's command, for one workspace folder. It answers at once; the run goes
// on in the background (the server reports its progress and says when the model is in use).
export const LEARN_COMMAND = "canvas-ls.learnWorkspace";

export function learnParams(folderUri: string): { command: string; arguments: { folder: string }[] } {
  return { command: LEARN_COMMAND, arguments: [{ folder: folderUri }] };
}

export interface LearnResult {
  workspace?: string;
  minutes?: number;
  error?: string;
}

export function learnMessage(result: LearnResult): { level: "error" | "info"; text: string } {
  if (result.error) return { level: "error", text: `canvas-ls: ${result.error}` };
  return {
    level: "info",
    text: `canvas-ls: learning ${result.workspace} for ${result.minutes} min in the background (lowest CPU priority); ` +
      "its files use the new model once it is ready",
  };
}

// `canvas/status`' account of one request: shown, or why nothing was (a reason of the server's closed list, with
// its words and the details: both values of a confidence below the threshold, the engine's error...).
export interface StatusEntry {
  uri: string;
  shown: boolean;
  why: string | null;
  words: string | null;
  detail: string | null;
  source: string;
  invoked: boolean;
  ms: number;
}

export interface Status {
  engine: { state: string; model: string | null; error: string | null };
  requests: number;
  shown: number;
  silent: { why: string; count: number }[];
  last: StatusEntry[]; // newest first
  reasons: { why: string; words: string }[];
}

// What the status bar says of the last request: the reason it showed nothing, short for the bar and in words with
// its details for the tooltip ("cut" for an answer cut to its confident head); undefined for one shown whole. A
// reason this extension does not know shows as its text.
export function statusNote(last: StatusEntry | undefined): { short: string; long: string } | undefined {
  if (!last) return undefined;
  if (last.shown) return last.detail ? { short: "cut", long: last.detail } : undefined;
  const short = last.why ?? "nothing shown";
  const words = last.words ?? short;
  return { short, long: last.detail ? `${words} (${last.detail})` : words };
}

// The log's account of the last requests (newest first): why each showed nothing, or that it showed a suggestion.
export function statusLines(status: Status, count = 5): string[] {
  return status.last.slice(0, count).map((entry) => {
    const note = statusNote(entry);
    const what = entry.shown ? (note ? `shown, ${note.long}` : "shown") : `nothing shown: ${note?.long ?? "?"}`;
    return `[canvas-ls] ${entry.invoked ? "asked" : "typing"}, ${entry.ms} ms: ${what}`;
  });
}

// `canvas/fillRegions`: the commands "Fill holes" (the placeholders of the function or class at the cursor) and
// "Rewrite selection" (the selection, starting from its text). The extension applies the returned edit itself.
export interface LspPosition {
  line: number;
  character: number;
}

export interface LspRange {
  start: LspPosition;
  end: LspPosition;
}

export interface FillRegionsParams {
  textDocument: { uri: string };
  position?: LspPosition;
  regions?: { range: LspRange; strength: number }[];
}

export function fillHolesParams(uri: string, position: LspPosition): FillRegionsParams {
  return { textDocument: { uri }, position };
}

export function rewriteParams(uri: string, range: LspRange, strength: number): FillRegionsParams {
  return { textDocument: { uri }, regions: [{ range, strength }] };
}

export interface FillRegionsResult {
  version: number;
  edit: unknown | null; // an LSP WorkspaceEdit of that version, or null when nothing is to be applied
  error: string | null;
  stale: boolean;
  message: string;
  regions: { range: LspRange; status: string; reason: string; text: string | null }[];
}

// What the user is told after a fill: an error, a warning naming the regions left as they were, or a plain note.
export function fillMessage(result: FillRegionsResult): { level: "error" | "warning" | "info"; text: string } {
  const left = result.regions.some((region) => region.status !== "filled");
  const level = result.error ? "error" : result.stale || left || !result.edit ? "warning" : "info";
  return { level, text: `canvas-ls: ${result.message}` };
}

export type LogLevel = "debug" | "info" | "warn" | "error";

const LEVELS: Record<string, LogLevel> = {
  DEBUG: "debug", INFO: "info", WARNING: "warn", ERROR: "error", CRITICAL: "error",
};

// One line of the server's stderr -> the output channel's level and the text to show (the channel adds its own
// time). The server logs "<date> <time>,<ms> LEVEL logger message" (server/cli.py); a line without that head
// continues the record before it (a traceback's frames, a progress bar), except that a traceback or a library's
// printed warning starts its own.
export function serverLogLine(line: string, previous: LogLevel): { level: LogLevel; text: string } {
  const record = /^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) (.*)$/.exec(line);
  if (record) return { level: LEVELS[record[1]], text: record[2] };
  if (line.startsWith("Traceback (most recent call last)")) return { level: "error", text: line };
  if (/^\S*Warning: /.test(line) || /:\d+: \w*Warning: /.test(line)) return { level: "warn", text: line };
  return { level: previous, text: line };
}
