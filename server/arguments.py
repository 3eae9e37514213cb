"""What the command line's parts share (`cli.py`, `train_cli.py`, `bench/cli.py`): the error a command reports, and
the model and settings arguments. Its own module so that none of them imports another's private helpers, and no
command's parser imports another command's code."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..engine.settings import QUANTIZE_CHOICES as QUANTIZE


class CliError(Exception):
    """A command's error, printed as one line (`canvas-ls: error: ...`), exit status 2."""


WORKSPACE_CACHE_HELP = ("weight of the token cache of the user's code (the document's and its repository's; 0: off; "
                        "default: the model's)")  # fmt: skip


def model_arguments(parser: argparse.ArgumentParser, device: bool = True) -> None:
    parser.add_argument("--model", help="model folder or hub id (default: the shipped model)")
    parser.add_argument("--adapter", help="a LoRA adapter folder (`canvas-ls train --lora`) to apply to the model")
    if device:
        parser.add_argument("--device", help="cpu, cuda, cuda:N or auto (default)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="auto: bf16 on GPUs and on CPUs with native bf16, else fp32")  # fmt: skip
    parser.add_argument("--quantize", choices=QUANTIZE, default="auto",
                        help="the layers' weights: auto picks none, int8 or int4 (torchao) to fit a GPU's free "
                        "memory, and on a CPU int8-dynamic (int8 weights and activations, torch's fbgemm: the fast "
                        "one there) for models of 100M+ weights, else none; int4 needs an NVIDIA GPU of compute "
                        "capability 8.0+")  # fmt: skip


def load_engine(args: argparse.Namespace, overrides: dict[str, Any] | None = None, **options: Any) -> Any:
    """The engine of the command's model arguments (`model_arguments`); a model that is not there is refused before
    torch is imported (`model_source`: at once, where the imports take seconds)."""
    from ..engine.model_source import model_source

    model_source(args.model)
    from ..engine import Engine

    return Engine.load(args.model, getattr(args, "device", None), overrides, dtype=args.dtype, adapter=args.adapter,
                       quantize=args.quantize, **options)  # fmt: skip


def settings_argument(parser: argparse.ArgumentParser) -> None:
    help_text = "any infill setting, e.g. --set min_new_tokens=1 (repeatable; VALUE is JSON or text)"
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings", help=help_text)


def parse_settings(pairs: list[str]) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CliError(f"--set wants KEY=VALUE, got '{pair}'")
        try:
            settings[key] = json.loads(value)
        except json.JSONDecodeError:
            settings[key] = value
    return settings


def host_port(text: str) -> tuple[str, int]:
    """HOST:PORT (--tcp, --http) as its two parts."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise CliError(f"wanted HOST:PORT, got '{text}'")
    return host, int(port)
