"""The compiling child's process (`python -m canvas_ls.engine.compile_worker`, started by `compile_child.py`): an
engine of the model, its decoder compiled and each graph saved at the lowest CPU priority (`compiled.py`). Its own
module: it loads an `Engine`, which `compiled.py` (imported by the engine) must not."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from .compiled import CompiledDecoder, compiler_dies_with_parent, keep_inductor_cache, warm_compiler_caches
from .engine import Engine
from .paths import lowest_priority
from .threads import full_threads


def main(argv: list[str] | None = None) -> int:
    """`python -m canvas_ls.engine.compile_worker MODEL --dtype D --quantize Q --backend B`: compile and save the
    decoder graphs of an engine of that model at the lowest CPU priority, one JSON line on stdout per graph saved (what
    `CompiledDecoder` runs when its graphs are not saved yet)."""
    parser = argparse.ArgumentParser(prog="python -m canvas_ls.engine.compile_worker")
    parser.add_argument("model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantize", default="auto")
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args(argv)
    compiler_dies_with_parent()
    lowest_priority()
    keep_inductor_cache()
    warm_compiler_caches()  # on the other core while the model loads and is traced
    engine = Engine.load(args.model, "cpu", dtype=args.dtype, quantize=args.quantize)
    engine.threads = None  # compiled with every thread, whatever the load: the engine checks its guards with as many
    torch.set_num_threads(full_threads())
    decoder = CompiledDecoder(engine.loaded.model, "on", backend=args.backend)
    decoder.announce = lambda rows: print(json.dumps({"graph": rows}), flush=True)
    engine.decoder = decoder
    engine.warm_up(background=False, elsewhere=False)
    if decoder.state != "ready":
        print(f"compiling failed: {decoder.detail}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
