// Next edits (`canvas/nextEdit`): what the one key does, and what the decorations say. No `vscode` import here, so
// the node tests check exactly what the extension decides.

export interface Position {
  line: number;
  character: number;
}

export interface Range {
  start: Position;
  end: Position;
}

export interface NextEdit {
  textDocument: { uri: string };
  range: Range;
  newText: string;
  confidence: number;
  predictor: string; // "repeat" or "canvas"
  away: boolean; // off the cursor's line: shown as a place to jump to
}

export interface NextEditResult {
  version: number | null;
  edits: NextEdit[];
  reason: string | null; // why there is none
}

export function nextEditParams(uri: string, version: number, position: Position): Record<string, unknown> {
  return { textDocument: { uri, version }, position };
}

// One key for next edits: with none shown, ask; with one shown elsewhere, jump to it; at it (its first line, in its
// document), accept it.
export type NextEditStep = "ask" | "jump" | "accept";

export function nextEditStep(shown: NextEdit | undefined, uri: string, cursorLine: number): NextEditStep {
  if (!shown) return "ask";
  return shown.textDocument.uri === uri && shown.range.start.line === cursorLine ? "accept" : "jump";
}

// The text shown after the replaced span: the new text's first line, "…" when it has more.
export function nextEditLabel(edit: NextEdit): string {
  const [first, ...rest] = edit.newText.split("\n");
  return rest.length ? `${first} …` : first;
}

// What the status bar says after asking.
export function nextEditMessage(result: NextEditResult): string {
  if (!result.edits.length) return `canvas-ls: no next edit: ${result.reason ?? "nothing to change"}`;
  const count = result.edits.length;
  return `canvas-ls: ${count} next edit${count > 1 ? "s" : ""}: Tab to jump, Tab to accept, Escape to dismiss`;
}
