// canvas-ls's VS Code extension in a real VS Code: code-server (VS Code in the browser) on loopback, driven by
// Debian's headless Chromium through puppeteer-core. Run by ./run.sh, which installs all of it (see there).
//
// 1. With the tiny model whose answers are known in advance (` None` then `code` in every slot): open a Python file,
//    type a space after `return`, wait for the ghost text, check it equals the server's answer (its log, at DEBUG,
//    which the output channel must show at level debug) and the known text, take a screenshot, accept with Tab, save,
//    and check the file on disk.
//    Then next edits: a rename typed in the definition, Alt+] shows the other use, Tab jumps, Tab accepts.
// 2. The status bar item: why a request showed nothing (typing inside a word), the latency after a completion; a
//    click on it shows the log with the last requests; the toggle command turns inline completion off and on.
// 2a. Partial accepts, with a model that writes ` None` in every slot ("None None None None" in a comment): Ctrl+Right
//    (VS Code's "Accept Next Word") takes "None" and the rest stays shown; Ctrl+Down (the extension's binding of "Accept
//    Next Line") takes the rest.
// 3. A model that fails to load: an error notification that says so, the status bar's error icon, no crash.
// 4. The shipped default model: only that a request makes the round trip (its answers are not known in advance).
//
// Environment: CANVAS_LS_PYTHON (a Python with canvas-ls installed), CANVAS_LS_FIXED_MODEL (`canvas-ls
// make-tiny-model DIR --writes code ' None'`), CANVAS_LS_WORDS_MODEL (`--writes ' None'`), CANVAS_LS_VSIX,
// CODE_SERVER, CHROMIUM, OUT (screenshots, report).
import { spawn, spawnSync } from "node:child_process";
import { mkdirSync, mkdtempSync, readFileSync, readdirSync, statSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import puppeteer from "puppeteer-core";

const env = (name) => {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set (run ./run.sh)`);
  return value;
};
const [python, fixedModel, wordsModel, vsix, codeServer, chromium, out] = ["CANVAS_LS_PYTHON", "CANVAS_LS_FIXED_MODEL",
  "CANVAS_LS_WORDS_MODEL", "CANVAS_LS_VSIX", "CODE_SERVER", "CHROMIUM", "OUT"].map(env);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const report = { steps: [] };
const step = (name, details = {}) => {
  report.steps.push({ name, ...details, at_s: Math.round((Date.now() - started) / 100) / 10 });
  console.log(`ok  ${name}`, Object.keys(details).length ? JSON.stringify(details) : "");
};
const started = Date.now();

async function until(what, probe, timeoutMs = 120000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await probe();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(200);
  }
}

// --- a VS Code profile with the extension installed, and a workspace -----------------------------------------------
const root = mkdtempSync(join(tmpdir(), "canvas-ls-vscode-"));
const [userData, extensions, workspace] = ["user-data", "extensions", "workspace"].map((name) => join(root, name));
for (const folder of [join(userData, "User"), extensions, workspace]) mkdirSync(folder, { recursive: true });
const file = join(workspace, "area.py");
writeFileSync(file, "def area(width, height):\n    return\n\n\nprint(area(2, 3))\n");
const settingsFile = join(userData, "User", "settings.json");
const settings = (model) => writeFileSync(settingsFile, JSON.stringify({
  "security.workspace.trust.enabled": false,
  "workbench.startupEditor": "none",
  "telemetry.telemetryLevel": "off",
  "extensions.autoCheckUpdates": false,
  "editor.quickSuggestions": { other: false, comments: false, strings: false },
  "editor.suggestOnTriggerCharacters": false,  // the suggest widget would hide the ghost text
  "editor.inlineSuggest.enabled": true,
  "chat.disableAIFeatures": true,  // VS Code's own chat panel would take a third of the screen
  "workbench.secondarySideBar.defaultVisibility": "hidden",
  // At DEBUG the server logs what it offered each request (the extension's log, canvas-ls.log): the server's answer.
  "canvasLs.command": [python, "-m", "canvas_ls.server.cli", "serve", "--log-level", "DEBUG"],
  "canvasLs.model": model,
  "canvasLs.device": "cpu",
  "canvasLs.maxNewTokens": { singleLine: 4 },  // the fixed model writes to the cap: "None" and 3 x "code"
}, null, 2));
settings(fixedModel);
const installed = spawnSync(codeServer, ["--user-data-dir", userData, "--extensions-dir", extensions,
  "--install-extension", vsix], { encoding: "utf8" });
if (installed.status !== 0) throw new Error(`installing the .vsix failed: ${installed.stderr}`);
step("vsix installed", { output: installed.stdout.trim().split("\n").pop() });

// --- code-server and the browser -------------------------------------------------------------------------------------
const port = 20000 + Math.floor(Math.random() * 20000);
// Its own runtime folder (a resident engine of its own) and state folder (the statistics this run records).
const serverEnv = { XDG_RUNTIME_DIR: join(root, "run"), XDG_STATE_HOME: join(root, "state") };
const statistics = () => JSON.parse(spawnSync(python, ["-m", "canvas_ls.server.cli", "stats", "--json"],
  { encoding: "utf8", env: { ...process.env, ...serverEnv } }).stdout).total;
const server = spawn(codeServer, ["--bind-addr", `127.0.0.1:${port}`, "--auth", "none", "--user-data-dir", userData,
  "--extensions-dir", extensions, "--disable-telemetry", "--disable-update-check", "--disable-workspace-trust",
  // Log output channels keep debug lines (the server's answers, logged at DEBUG; at the default, info, they are
  // dropped: the extension shows each server line at its own level).
  "--log", "debug", workspace], { stdio: ["ignore", "pipe", "pipe"], env: { ...process.env, ...serverEnv } });
let serverLog = "";
server.stdout.on("data", (chunk) => (serverLog += chunk));
server.stderr.on("data", (chunk) => (serverLog += chunk));
mkdirSync(join(root, "run"), { recursive: true, mode: 0o700 });
await until("code-server to listen", () => serverLog.includes("HTTP server listening"), 60000);

const browser = await puppeteer.launch({
  executablePath: chromium,
  headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--window-size=1280,800"],
  defaultViewport: { width: 1280, height: 800 },
});
const page = await browser.newPage();
// A reload may meet VS Code's "leave the page?" check (its onbeforeunload): accepted, and said in the report.
const dialogs = [];
page.on("dialog", async (dialog) => {
  dialogs.push(`${dialog.type()}: ${dialog.message()}`);
  await dialog.accept();
});
const failures = [];
page.on("pageerror", (error) => failures.push(String(error)));
const areaOpen = () => page.evaluate(() =>
  [...document.querySelectorAll(".tabs-container .tab")].some((tab) => tab.textContent.includes("area.py")));

// The text of the extension's output channel ("canvas-ls"), as code-server writes it to its log files.
function channelLogs() {
  const logs = [];
  const walk = (folder) => {
    for (const name of readdirSync(folder)) {
      const path = join(folder, name);
      if (statSync(path).isDirectory()) walk(path);
      else if (name.endsWith(".log") && name.includes("canvas-ls")) logs.push(readFileSync(path, "utf8"));
    }
  };
  walk(join(userData, "logs"));
  return logs;
}

// Open area.py with Quick Open (a window reload restores it by itself).
async function openArea() {
  await sleep(2000);
  if (await areaOpen()) return;
  await page.keyboard.down("Control"); await page.keyboard.press("KeyP"); await page.keyboard.up("Control");
  await until("Quick Open", () => page.$(".quick-input-widget:not([style*='display: none']) input"));
  await page.keyboard.type("area.py");
  await until("the file in Quick Open", () => page.evaluate(() =>
    [...document.querySelectorAll(".quick-input-list .monaco-list-row")].some((row) => row.textContent.includes("area.py"))));
  await until("the file's editor", async () => {
    const open = await areaOpen();
    if (!open) await page.keyboard.press("Enter");
    return open;
  }, 20000);
  await sleep(500);
}

// New user settings, then a window reload (code-server does not notice a settings file changed behind its back).
async function reloadWith(model) {
  settings(model);
  await page.reload({ waitUntil: "domcontentloaded" });
  await until("the workbench", () => page.$(".monaco-workbench .statusbar"), 90000);
  await openArea();
}

try {
  await page.goto(`http://127.0.0.1:${port}/?folder=${encodeURIComponent(workspace)}`, { waitUntil: "domcontentloaded" });
  await until("the workbench", () => page.$(".monaco-workbench"), 90000);
  step("VS Code loaded", { version: (serverLog.match(/code-server ([\d.]+)/) || [])[1] });

  // Open area.py (Quick Open), wait for the server to load the model (the status bar's check icon).
  const statusItem = () => page.evaluate(() => {
    const item = [...document.querySelectorAll(".statusbar-item")].find((el) => el.textContent.includes("canvas-ls"));
    if (!item) return null;
    const icon = item.querySelector(".codicon");
    return { text: item.textContent.trim(), icon: icon ? [...icon.classList].find((c) => c.startsWith("codicon-") && c !== "codicon") : null };
  });
  // The ghost text shown (null: none).
  const ghostText = () => page.evaluate(() => {
    const parts = [...document.querySelectorAll(".ghost-text-decoration, .ghost-text-decoration-preview")];
    // VS Code draws the ghost text's spaces as no-break spaces
    return parts.length ? parts.map((el) => el.textContent).join("").replace(/\u00a0/g, " ") : null;
  });
  // The status bar item once it shows `icon` (codicon-check: ready; -circle-slash: off; -error: failed).
  const statusIcon = (what, icon, timeoutMs) => until(what, async () => {
    const item = await statusItem();
    return item && item.icon === icon ? item : null;
  }, timeoutMs);
  await openArea();
  const ready = await statusIcon("the model to load (status bar)", "codicon-check", 180000);
  step("extension active, model loaded", { status: ready.text });

  // Line 2 ("    return"), at its end, type a space: VS Code asks for an inline completion.
  await page.keyboard.down("Control"); await page.keyboard.press("KeyG"); await page.keyboard.up("Control");
  await page.keyboard.type("2");
  await page.keyboard.press("Enter");
  await page.keyboard.press("End");
  await page.keyboard.type(" ");
  const ghost = await until("the ghost text", ghostText, 60000);
  const editorBox = await (await page.$(".editor-group-container")).boundingBox();
  await page.screenshot({ path: join(out, "ghost-text.png"),
    clip: { x: editorBox.x, y: editorBox.y, width: Math.min(editorBox.width, 720), height: 170 } });
  const answered = await until("the server's log of its answer", () => {
    for (const log of channelLogs()) {
      // The output channel's line: "<time> [debug] request N offered ..." (the server logged it at DEBUG).
      const offeredLine = /\[(\w+)\][^\n]*request \d+ offered ("(?:[^"\\]|\\.)*") at offsets/;
      const match = log.match(offeredLine);
      if (match) return { text: JSON.parse(match[2]), level: match[1] };
    }
    return null;
  }, 20000);
  const offered = answered.text;
  const known = "Nonecodecodecode";
  if (ghost !== offered || !ghost.startsWith("Nonecode") || ghost !== known)
    throw new Error(`ghost text ${JSON.stringify(ghost)}, server answered ${JSON.stringify(offered)}`);
  if (answered.level !== "debug") throw new Error(`the server's DEBUG line shows at level ${answered.level}`);
  step("ghost text equals the server's answer", { ghost, logLevel: answered.level });

  await page.keyboard.press("Tab");
  await sleep(500);
  await page.keyboard.down("Control"); await page.keyboard.press("KeyS"); await page.keyboard.up("Control");
  const line = await until("the accepted text on disk", () => {
    const second = readFileSync(file, "utf8").split("\n")[1];
    return second !== "    return" && second !== "    return " ? second : null;
  }, 10000);
  if (line !== `    return ${ghost}`) throw new Error(`after Tab the line is ${JSON.stringify(line)}`);
  step("Tab accepted it; saved file", { line });

  // Next edits: rename `area` in its definition, Alt+] shows the other use (line 5) with the new name after it, Tab
  // jumps there, Tab accepts it; the saved file has both renamed.
  await page.keyboard.down("Control"); await page.keyboard.press("KeyG"); await page.keyboard.up("Control");
  await page.keyboard.type("1:5"); // line 1, column 5: the start of `area`
  await page.keyboard.press("Enter");
  await sleep(500);
  await page.keyboard.down("Control"); await page.keyboard.down("Shift");
  await page.keyboard.press("ArrowRight");
  await page.keyboard.up("Shift"); await page.keyboard.up("Control");
  await page.keyboard.type("surface");
  await sleep(500);
  await page.keyboard.press("Escape"); // a ghost text the typing asked for: dismissed
  await page.keyboard.down("Alt"); await page.keyboard.press("BracketRight"); await page.keyboard.up("Alt");
  const shown = await until("the next-edit decoration", () => page.evaluate(() => {
    for (const el of document.querySelectorAll(".view-lines span")) {
      const after = getComputedStyle(el, "::after").content;
      if (el.textContent === "surface" && el.className.includes("ced-")) return "text";
      if (after === '"surface"') return "after";
    }
    return null;
  }), 30000);
  const codeBox = await (await page.$(".editor-group-container .monaco-editor")).boundingBox();
  await page.screenshot({ path: join(out, "next-edit.png"),
    clip: { x: codeBox.x, y: codeBox.y, width: Math.min(codeBox.width, 560), height: 130 } });
  await page.keyboard.press("Tab"); // jump to it
  await sleep(500);
  await page.keyboard.press("Tab"); // accept it
  await sleep(500);
  await page.keyboard.down("Control"); await page.keyboard.press("KeyS"); await page.keyboard.up("Control");
  const renamed = await until("both renamed on disk", () => {
    const lines = readFileSync(file, "utf8").split("\n");
    return lines[0].startsWith("def surface(") && lines[4] === "print(surface(2, 3))" ? lines : null;
  }, 10000);
  step("next edit: shown, jumped to with Tab, accepted with Tab", { shown, first: renamed[0], last: renamed[4] });

  // Why nothing was shown: typing inside a word, where canvas-ls asks nothing; the status bar says so.
  await page.keyboard.down("Control"); await page.keyboard.press("KeyG"); await page.keyboard.up("Control");
  await page.keyboard.type("1:7"); // inside `surface`
  await page.keyboard.press("Enter");
  await sleep(500);
  await page.keyboard.type("x");
  const silent = await until("the reason in the status bar", async () => {
    const item = await statusItem();
    return item && item.text.includes("· inside a word") ? item : null;
  }, 20000);
  await page.keyboard.down("Control"); await page.keyboard.press("KeyZ"); await page.keyboard.up("Control");
  await page.keyboard.down("Control"); await page.keyboard.press("KeyS"); await page.keyboard.up("Control");
  const restored = await until("the file as it was", () =>
    readFileSync(file, "utf8").startsWith("def surface(") ? true : null, 10000);
  step("status bar: why nothing was shown", { status: silent.text, restored });

  // The status bar: latency after the completion; a click shows the log with the last requests; the toggle command
  // turns inline completion off and back on.
  const withLatency = await until("latency in the status bar", async () => {
    const item = await statusItem();
    return item && / \d+ ms/.test(item.text) ? item : null;
  });
  await page.evaluate(() =>
    [...document.querySelectorAll(".statusbar-item")].find((el) => el.textContent.includes("canvas-ls"))
      .querySelector("a, .statusbar-item-label").click());
  const logged = await until("the log with the last requests", () => {
    for (const log of channelLogs()) {
      const at = log.indexOf("[canvas-ls] the last requests, newest first:");
      const shown = at >= 0 && log.slice(at).match(/\[canvas-ls\] (typing|asked), [\d.]+ ms: [^\n]+/);
      if (shown && log.slice(at).includes("doctor` checks the installation")) return shown[0];
    }
    return null;
  }, 20000);
  const toggle = async () => {
    await page.keyboard.press("F1");
    await until("the command palette", () => page.$(".quick-input-widget:not([style*='display: none']) input"));
    await page.keyboard.type("canvas-ls: Toggle inline completion");
    await sleep(500);
    await page.keyboard.press("Enter");
  };
  await toggle();
  const off = await statusIcon("the toggle off", "codicon-circle-slash", 10000);
  await toggle();
  const on = await statusIcon("the toggle back on", "codicon-check", 10000);
  step("status bar: latency; a click shows the log; toggled off and on", { ready: withLatency.text, log: logged,
    off: off.text, on: on.text });

  // Partial accepts: the words model answers "None None None None" in a comment at the end of the file.
  await reloadWith(wordsModel);
  await statusIcon("the words model to load", "codicon-check", 180000);
  await page.keyboard.down("Control"); await page.keyboard.press("End"); await page.keyboard.up("Control");
  await page.keyboard.type("x = 1  #");
  await sleep(300);
  await page.keyboard.type(" ");
  const whole = await until("the words ghost text", ghostText, 60000);
  if (whole !== "None None None None") throw new Error(`the words model's ghost text is ${JSON.stringify(whole)}`);
  const lastLine = () => readFileSync(file, "utf8").trimEnd().split("\n").pop();
  const save = async () => {
    await page.keyboard.down("Control"); await page.keyboard.press("KeyS"); await page.keyboard.up("Control");
  };
  await page.keyboard.down("Control"); await page.keyboard.press("ArrowRight"); await page.keyboard.up("Control");
  const rest = await until("the rest still shown", async () => {
    const ghost = await ghostText();
    return ghost && ghost !== whole ? ghost : null;
  }, 20000);
  await save();
  const word = await until("the accepted word on disk", () => (lastLine() === "x = 1  # None" ? lastLine() : null), 10000);
  if (rest !== " None None None") throw new Error(`after the word, the ghost text is ${JSON.stringify(rest)}`);
  await page.keyboard.down("Control"); await page.keyboard.press("ArrowDown"); await page.keyboard.up("Control");
  await sleep(500);
  await save();
  const restOfLine = await until("the accepted line on disk", () =>
    (lastLine() === "x = 1  # None None None None" ? lastLine() : null), 10000);
  // A word taken, the rest dismissed (Escape, then typing on): VS Code runs no command on a partial accept; the
  // server sees the word kept where the suggestion was shown, and the statistics count it as a partial accept of
  // "None", 4 characters, or " None", 5, when the suggestion shown was the one asked at "#" and the space was typed
  // through (typed-through characters count as taken, as a suggestion typed through to its end counts accepted).
  const before = statistics();
  await page.keyboard.press("Enter");
  await page.keyboard.type("z = 2  #");
  await sleep(300);
  await page.keyboard.type(" ");
  await until("the words ghost text again", async () => ((await ghostText()) === whole ? whole : null), 60000);
  await page.keyboard.down("Control"); await page.keyboard.press("ArrowRight"); await page.keyboard.up("Control");
  await until("the rest shown again", async () => ((await ghostText()) === rest ? rest : null), 20000);
  await page.keyboard.press("Escape");
  await page.keyboard.press("Enter");
  await page.keyboard.type("w = 3  #");
  await sleep(300);
  await page.keyboard.type(" ");
  let now = before;
  const counted = await until("the partial accept in the statistics", () => {
    now = statistics();
    return now.partial === before.partial + 1 && [4, 5].includes(now.chars_accepted - before.chars_accepted) ? now : null;
  }, 30000).catch((error) => {
    throw new Error(`${error.message}: before ${JSON.stringify(before)}, now ${JSON.stringify(now)}; the file ` +
      JSON.stringify(readFileSync(file, "utf8").slice(-120)));
  });
  await page.keyboard.press("Escape");
  await save();  // a page with unsaved changes asks before it reloads (the next step reloads it)
  step("partial accepts: Ctrl+Right took a word, the rest still shown; Ctrl+Down the rest; a word then Escape is " +
    "counted as a partial accept of the word (4 characters, 5 with the space typed through)", { whole, word, rest, line: restOfLine,
    statistics: { partial: counted.partial, chars_accepted: counted.chars_accepted, dismissed: counted.dismissed } });

  // A model that fails to load: the server says why, in a notification and the status bar.
  await reloadWith(join(root, "no-such-model"));
  const notice = await until("the error notification", () => page.evaluate(() => {
    const messages = [...document.querySelectorAll(".notification-list-item-message")].map((el) => el.textContent);
    return messages.find((text) => text.includes("failed to load")) || null;
  }), 120000);
  const failed = await statusIcon("the status bar's error icon", "codicon-error", 30000);
  await page.screenshot({ path: join(out, "model-failed.png") });
  step("a model that fails to load is reported", { notification: notice, status: failed.text });

  // The shipped default model: the round trip happens (what it writes is not known in advance).
  await reloadWith("");
  await statusIcon("the default model to load", "codicon-check", 180000);
  await page.keyboard.down("Control"); await page.keyboard.press("KeyG"); await page.keyboard.up("Control");
  await page.keyboard.type("5");
  await page.keyboard.press("Enter");
  await page.keyboard.press("End");
  await page.keyboard.type("\nwidth = ");
  const roundTrip = await until("a request answered by the default model", async () => {
    const item = await statusItem();
    return item && / \d+ ms/.test(item.text) ? item : null;
  }, 60000);
  step("default model: a request made the round trip", { status: roundTrip.text });
  if (failures.length) throw new Error(`page errors: ${failures.join("; ")}`);
  report.ok = true;
} catch (error) {
  report.ok = false;
  report.error = String(error.stack || error);
  await page.screenshot({ path: join(out, "failure.png") }).catch(() => {});
  console.error(error);
  console.error(serverLog.slice(-3000));
} finally {
  report.dialogs = dialogs;
  writeFileSync(join(out, "report.json"), JSON.stringify(report, null, 2));
  await browser.close();
  server.kill();
  // The resident engines the language servers started (one per model) would idle for 30 minutes: stop them.
  spawnSync("pkill", ["-f", join(root, "run", "canvas-ls")]);
}
process.exit(report.ok ? 0 : 1);
