// The extension's server launch, tested in node: exactly the command and initializationOptions the extension
// builds, a real `canvas-ls serve`, and initialize + inline completion over JSON-RPC (no VS Code binary here).
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync, spawn } from "node:child_process";
import * as fs from "node:fs";
import * as http from "node:http";
import * as os from "node:os";
import * as path from "node:path";
import * as readline from "node:readline";
import { pathToFileURL } from "node:url";
import {
  createProtocolConnection,
  DidChangeTextDocumentNotification,
  DidOpenTextDocumentNotification,
  ExitNotification,
  InitializedNotification,
  InitializeRequest,
  InlineCompletionRequest,
  InlineCompletionTriggerKind,
  ShutdownRequest,
  StreamMessageReader,
  StreamMessageWriter,
} from "vscode-languageserver-protocol/node";
import {
  CanvasSettings,
  DEFAULT_SETTINGS,
  FillRegionsResult,
  fillHolesParams,
  fillMessage,
  initializationOptions,
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
} from "../config";
import { NextEdit, NextEditResult, nextEditLabel, nextEditMessage, nextEditParams, nextEditStep } from "../nextEdit";

const python = process.env.CANVAS_PYTHON ?? "python3";

// Kill the engines whose sockets are in `folder` (their pid from GET /health over the unix socket).
async function stopEngines(folder: string): Promise<void> {
  const sockets = fs.existsSync(folder) ? fs.readdirSync(folder).filter((name) => name.endsWith(".sock")) : [];
  for (const name of sockets) {
    const health = await new Promise<string>((resolve) => {
      const request = http.get({ socketPath: path.join(folder, name), path: "/health" }, (response) => {
        let body = "";
        response.on("data", (chunk) => (body += chunk));
        response.on("end", () => resolve(body));
      });
      request.on("error", () => resolve(""));
    });
    try {
      process.kill(JSON.parse(health).pid, "SIGKILL");
    } catch {
      // not running, or no answer: nothing to stop
    }
  }
}
const repo = path.resolve(__dirname, "..", "..", "..", "..");

test("the default command is canvas-ls serve; a pythonPath runs the module", () => {
  assert.deepEqual(serverCommand(DEFAULT_SETTINGS), { command: "canvas-ls", args: ["serve"] });
  assert.deepEqual(serverCommand({ ...DEFAULT_SETTINGS, pythonPath: "/usr/bin/python3" }), {
    command: "/usr/bin/python3",
    args: ["-m", "canvas_ls.server.cli", "serve"],
  });
});

test("settings become the server's option tree", () => {
  const options = initializationOptions({
    ...DEFAULT_SETTINGS, model: "/m", device: "cpu", gapTokens: { singleLine: 8 }, maxNewTokens: { singleLine: 4 },
  });
  assert.deepEqual(options, {
    engine: { model: "/m", device: "cpu", quantize: "auto", backend: "resident", workspace_models: true },
    completion: { gap_tokens_single_line: 8, max_new_tokens_single_line: 4 },
  });
  assert.deepEqual(initializationOptions(DEFAULT_SETTINGS).engine, {
    model: null, device: "auto", quantize: "auto", backend: "resident", workspace_models: true,
  });
  const learning = initializationOptions({ ...DEFAULT_SETTINGS, workspaceModels: false, learnMinutes: 5 }).engine;
  assert.deepEqual(learning, {
    model: null, device: "auto", quantize: "auto", backend: "resident", workspace_models: false, learn_minutes: 5,
  });
  const small = initializationOptions({ ...DEFAULT_SETTINGS, device: "cuda", quantize: "int4" }).engine as { quantize: string };
  assert.equal(small.quantize, "int4"); // DiffusionGemma on a 24 GB card
  const local = initializationOptions({ ...DEFAULT_SETTINGS, backend: "local" }).engine as { backend: string };
  assert.equal(local.backend, "local");
  const team = initializationOptions({ ...DEFAULT_SETTINGS, backend: "remote", engineUrl: "http://gpu-box:8000" }).engine;
  assert.deepEqual(team, {
    model: null, device: "auto", quantize: "auto", backend: "remote", workspace_models: true, url: "http://gpu-box:8000",
  });
  const strict = initializationOptions({ ...DEFAULT_SETTINGS, minConfidence: 0 }).completion as Record<string, unknown>;
  assert.equal(strict.min_confidence, 0); // 0 is a value (show everything), not "unset"
});

test("the status bar's note says why nothing was shown", () => {
  const entry = { uri: "u", shown: false, source: "hidden", invoked: false, ms: 80 };
  const hidden = "hidden: confidence 0.12 below 0.40 (geometric score)";
  const low = { ...entry, why: "low confidence", words: "the model's confidence is below the display threshold" };
  assert.deepEqual(statusNote({ ...low, detail: hidden }), {
    short: "low confidence",
    long: `the model's confidence is below the display threshold (${hidden})`,
  });
  const word = { ...entry, why: "inside a word", words: "the cursor is inside a word", detail: null };
  assert.deepEqual(statusNote(word), { short: "inside a word", long: "the cursor is inside a word" });
  const unknown = { ...entry, why: "a reason from a newer server", words: null, detail: null };
  assert.deepEqual(statusNote(unknown), { short: "a reason from a newer server", long: "a reason from a newer server" });
  const cut = { ...entry, shown: true, why: null, words: null, detail: "cut to its confident head: confidence 0.3" };
  assert.deepEqual(statusNote(cut), { short: "cut", long: "cut to its confident head: confidence 0.3" });
  assert.equal(statusNote({ ...cut, detail: null }), undefined);
  assert.equal(statusNote(undefined), undefined);
  const status = { engine: { state: "ready", model: null, error: null }, requests: 3, shown: 1, silent: [], reasons: [],
    last: [{ ...low, detail: hidden, ms: 41.5 }, { ...word, invoked: true, ms: 2 }, { ...entry, shown: true, why: null,
      words: null, detail: null, ms: 120 }] };
  const withLevel = { ...DEFAULT_SETTINGS, command: ["canvas-ls", "serve", "--log-level", "debug"] };
  assert.equal(doctorCommand(withLevel), "canvas-ls doctor");
  assert.equal(doctorCommand({ ...DEFAULT_SETTINGS, pythonPath: "/venv/bin/python" }),
    "/venv/bin/python -m canvas_ls.server.cli doctor");
  assert.deepEqual(statusLines(status), [
    `[canvas-ls] typing, 41.5 ms: nothing shown: the model's confidence is below the display threshold (${hidden})`,
    "[canvas-ls] asked, 2 ms: nothing shown: the cursor is inside a word",
    "[canvas-ls] typing, 120 ms: shown",
  ]);
});

test("server log lines reach the output channel at their own level", () => {
  const line = (text: string, previous: LogLevel = "info") => serverLogLine(text, previous);
  assert.deepEqual(line("2026-12-01 01:02:03,456 INFO canvas-ls.backend engine ready"),
    { level: "info", text: "canvas-ls.backend engine ready" });
  assert.equal(line("2026-12-01 01:02:03,456 WARNING canvas-ls.lsp slow").level, "warn");
  assert.equal(line("2026-12-01 01:02:03,456 DEBUG pygls sent").level, "debug");
  assert.equal(line("2026-12-01 01:02:03,456 ERROR canvas-ls.lsp failed").level, "error");
  assert.equal(line("Traceback (most recent call last):").level, "error");
  assert.equal(line('  File "x.py", line 1, in <module>', "error").level, "error"); // a traceback's frames
  assert.equal(line("/x/y.py:3: UserWarning: deprecated").level, "warn");
  assert.equal(line("learning  40%|####", "info").level, "info");
});

test("the fill commands' requests, and what the user is told", () => {
  const manifest = JSON.parse(fs.readFileSync(path.join(__dirname, "..", "..", "package.json"), "utf8"));
  const titles = Object.fromEntries(
    manifest.contributes.commands.map((c: { command: string; title: string }) => [c.command, c.title]),
  );
  assert.equal(titles["canvasLs.fillHoles"], "canvas-ls: Fill holes");
  assert.equal(titles["canvasLs.rewriteSelection"], "canvas-ls: Rewrite selection");
  assert.equal(titles["canvasLs.learnWorkspace"], "canvas-ls: Learn this workspace");
  assert.deepEqual(learnParams("file:///src/app"), {
    command: "canvas-ls.learnWorkspace", arguments: [{ folder: "file:///src/app" }],
  });
  assert.equal(learnMessage({ error: "no folder to learn" }).level, "error");
  assert.match(learnMessage({ workspace: "/src/app", minutes: 10 }).text, /learning \/src\/app for 10 min/);
  const position = { line: 3, character: 4 };
  assert.deepEqual(fillHolesParams("file:///a.py", position), { textDocument: { uri: "file:///a.py" }, position });
  const range = { start: { line: 1, character: 0 }, end: { line: 2, character: 5 } };
  assert.deepEqual(rewriteParams("file:///a.py", range, 0.3), {
    textDocument: { uri: "file:///a.py" },
    regions: [{ range, strength: 0.3 }],
  });
  const base: FillRegionsResult = { version: 1, edit: {}, error: null, stale: false, message: "filled 1 of 1 region",
                                    regions: [{ range, status: "filled", reason: "", text: "x" }] };
  assert.deepEqual(fillMessage(base), { level: "info", text: "canvas-ls: filled 1 of 1 region" });
  assert.equal(fillMessage({ ...base, regions: [{ range, status: "syntax", reason: "r", text: null }] }).level, "warning");
  assert.equal(fillMessage({ ...base, edit: null, error: "regions 1 and 2 overlap" }).level, "error");
  assert.equal(fillMessage({ ...base, edit: null, stale: true }).level, "warning");
});

test("next edits: one key asks, jumps to the shown edit, accepts it at its line", () => {
  const edit: NextEdit = {
    textDocument: { uri: "file:///w/a.py" }, range: { start: { line: 3, character: 8 }, end: { line: 3, character: 13 } },
    newText: "acc", confidence: 0.85, predictor: "repeat", away: true,
  };
  assert.equal(nextEditStep(undefined, "file:///w/a.py", 1), "ask");
  assert.equal(nextEditStep(edit, "file:///w/a.py", 1), "jump");
  assert.equal(nextEditStep(edit, "file:///w/b.py", 3), "jump"); // the same line of another document
  assert.equal(nextEditStep(edit, "file:///w/a.py", 3), "accept");
  assert.equal(nextEditLabel(edit), "acc");
  assert.equal(nextEditLabel({ ...edit, newText: "x = 1\ny = 2" }), "x = 1 …");
  assert.deepEqual(nextEditParams("file:///w/a.py", 4, { line: 1, character: 7 }),
    { textDocument: { uri: "file:///w/a.py", version: 4 }, position: { line: 1, character: 7 } });
  assert.equal(nextEditMessage({ version: 4, edits: [edit, edit], reason: null }),
    "canvas-ls: 2 next edits: Tab to jump, Tab to accept, Escape to dismiss");
  assert.equal(nextEditMessage({ version: 4, edits: [], reason: "no recent edit in this document" }),
    "canvas-ls: no next edit: no recent edit in this document");
});

test("the server the extension starts answers initialize and an inline completion", { timeout: 180_000 }, async () => {
  const modelDir = fs.mkdtempSync(path.join(os.tmpdir(), "canvas-tiny-"));
  // The model whose answers are known in advance: "code" in every slot (" None" where "code" is barred), 4 at most.
  execFileSync(python, ["-m", "canvas_ls.server.cli", "make-tiny-model", modelDir, "--writes", "code", " None",
    "--max-new-tokens", "4"]);
  const settings: CanvasSettings = { ...DEFAULT_SETTINGS, pythonPath: python, model: modelDir, device: "cpu" };
  const { command, args } = serverCommand(settings);
  // The server starts a resident engine (the default backend): in a runtime folder of this test's own, stopped below.
  const runtime = fs.mkdtempSync(path.join(os.tmpdir(), "canvas-run-"));
  const env = { ...process.env, XDG_RUNTIME_DIR: runtime };
  // At INFO, so that the server has log lines to show: each must reach the output channel at its own level.
  const server = spawn(command, [...args, "--log-level", "INFO"], { stdio: ["pipe", "pipe", "pipe"], env });
  const logged: string[] = [];
  readline.createInterface({ input: server.stderr }).on("line", (line) => logged.push(line));
  const connection = createProtocolConnection(
    new StreamMessageReader(server.stdout),
    new StreamMessageWriter(server.stdin),
  );
  connection.listen();
  try {
    const init = await connection.sendRequest(InitializeRequest.type, {
      processId: process.pid,
      rootUri: null,
      capabilities: {},
      initializationOptions: initializationOptions(settings),
    });
    assert.ok(init.capabilities.inlineCompletionProvider, "inlineCompletionProvider is advertised");
    await connection.sendNotification(InitializedNotification.type, {});

    const file = path.join(repo, "fixtures", "javascript", "cart.js");
    const uri = pathToFileURL(file).toString();
    const text = fs.readFileSync(file, "utf8");
    await connection.sendNotification(DidOpenTextDocumentNotification.type, {
      textDocument: { uri, languageId: "javascript", version: 1, text },
    });
    for (let i = 0; i < 300; i++) {
      const stats = await connection.sendRequest<{ engine: { state: string } }>("canvas/stats", {});
      if (stats.engine.state === "ready") break;
      assert.notEqual(stats.engine.state, "failed");
      await new Promise((resolve) => setTimeout(resolve, 200));
    }
    const line = text.split("\n").findIndex((row) => row.trimEnd().endsWith("// TODO:"));
    const position = { line, character: text.split("\n")[line].length };
    const result = await connection.sendRequest(InlineCompletionRequest.type, {
      textDocument: { uri },
      position,
      context: { triggerKind: InlineCompletionTriggerKind.Automatic },
    });
    const items = Array.isArray(result) ? result : (result?.items ?? []);
    assert.equal(items.length, 1);
    assert.deepEqual(items[0].range, { start: position, end: position });
    // " None" after the comment's space (token healing), then "code" to the 48-token cap the settings give.
    assert.equal(items[0].insertText, "None" + "code".repeat(47));

    // "Fill holes" at the cursor in add(): its `// TODO:` comment is the hole; one request, one answer per hole.
    const holes = await connection.sendRequest<FillRegionsResult>(
      "canvas/fillRegions", fillHolesParams(uri, { line: line, character: 4 }),
    );
    assert.equal(holes.error, null);
    assert.deepEqual(holes.regions.map((region) => region.range), [
      { start: { line, character: 4 }, end: { line, character: text.split("\n")[line].length } },
    ]);
    // The model writes to the fill's budget without an end: the region is left as it was, and the user told why.
    assert.deepEqual(holes.regions.map((region) => [region.status, region.reason, region.text]),
      [["truncated", "the answer did not end within its token budget", null]]);
    // "Rewrite selection": the strength goes with the region; overlapping regions are a clear error.
    const selection = { start: { line: line + 1, character: 4 }, end: { line: line + 1, character: 14 } };
    const rewrite = await connection.sendRequest<FillRegionsResult>(
      "canvas/fillRegions", rewriteParams(uri, selection, 0.5),
    );
    assert.equal(rewrite.error, null);
    assert.deepEqual(rewrite.regions.map((region) => region.status), ["truncated"]);
    const overlap = await connection.sendRequest<FillRegionsResult>("canvas/fillRegions", {
      textDocument: { uri }, regions: [{ range: selection, strength: 1 }, { range: selection, strength: 1 }],
    });
    assert.equal(overlap.error, "regions 1 and 2 overlap");
    assert.equal(overlap.edit, null);
    // Next edits: a rename typed in a document; the server suggests the other uses, as the extension asks.
    const mean = "file:///w/mean.py";
    const before = "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total\n";
    await connection.sendNotification(DidOpenTextDocumentNotification.type, {
      textDocument: { uri: mean, languageId: "python", version: 1, text: before },
    });
    await connection.sendNotification(DidChangeTextDocumentNotification.type, {
      textDocument: { uri: mean, version: 2 },
      contentChanges: [{ range: { start: { line: 1, character: 4 }, end: { line: 1, character: 9 } }, text: "acc" }],
    });
    const next = await connection.sendRequest<NextEditResult>(
      "canvas/nextEdit", nextEditParams(mean, 2, { line: 1, character: 7 }),
    );
    assert.equal(next.reason, null);
    assert.deepEqual(next.edits.map((edit) => [edit.range.start.line, edit.range.start.character, edit.newText]),
      [[3, 8, "acc"], [4, 11, "acc"]]);
    // "Learn this workspace" for a folder that is not there: the server's clear error, nothing started
    const learn = await connection.sendRequest<LearnResult>(
      "workspace/executeCommand", learnParams(pathToFileURL(path.join(runtime, "missing")).toString()),
    );
    assert.match(learn.error ?? "", /no folder to learn/);
    await connection.sendRequest(ShutdownRequest.type);
    await connection.sendNotification(ExitNotification.type);
    await new Promise((resolve) => server.once("exit", resolve));
    let level: LogLevel = "info";
    const shown = logged.map((line) => (level = serverLogLine(line, level).level, serverLogLine(line, level)));
    // The engine's start and each request are INFO records: read as such (time and level taken off), none an error.
    assert.ok(shown.some((entry) => entry.level === "info" && entry.text.startsWith("canvas_ls.")), logged.join("\n"));
    assert.ok(shown.every((entry) => entry.level !== "error"), logged.join("\n"));
  } finally {
    connection.dispose();
    server.kill();
    await stopEngines(path.join(runtime, "canvas-ls"));
    fs.rmSync(modelDir, { recursive: true, force: true });
    fs.rmSync(runtime, { recursive: true, force: true });
  }
});
