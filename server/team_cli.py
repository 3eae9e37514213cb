"""`canvas-ls team`: the engine for a team on one deployment (Ray Serve, `engine/team.py`) and its users.

    canvas-ls team serve --model M --replicas N [--address RAY] [--http HOST:PORT] [--tokens FILE] ...
    canvas-ls team token add|revoke|list NAME --tokens FILE

Editors reach the deployment with `engine.backend: "remote"` and `engine.url` (their token in $CANVAS_LS_TOKEN or
`engine.api_key`). Needs the extra: `pip install 'canvas-ls[team]'`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

from ..engine.addresses import ServeError, check_host, loopback
from ..engine.paths import MAX_BATCH
from ..engine.settings import QUANTIZE_CHOICES as QUANTIZE
from .arguments import CliError, host_port

TOKENS_HELP = "the users' token file (`canvas-ls team token add`): one hashed token per user"


def add_parser(commands: Any) -> None:
    team = commands.add_parser("team", help="the engine for a team: a Ray Serve deployment, and its users' tokens")
    actions = team.add_subparsers(dest="team_command", required=True)

    serve = actions.add_parser("serve", help="start (or join a Ray cluster and start) the deployment; runs until "
                               "stopped")  # fmt: skip
    serve.add_argument("--model", help="model folder or hub id every replica loads (default: the shipped model)")
    serve.add_argument("--replicas", type=int, default=1, help="engine replicas (each one model and its batch)")
    serve.add_argument("--address", help="a Ray cluster to join (ray://HOST:PORT or HOST:PORT; default: start a "
                       "local one)")  # fmt: skip
    serve.add_argument("--http", default="127.0.0.1:8000", metavar="HOST:PORT", help="where editors reach it")
    serve.add_argument("--allow-remote", action="store_true", help="let --http listen on a non-loopback address "
                       "(needs --tokens)")  # fmt: skip
    serve.add_argument("--tokens", type=Path, help=TOKENS_HELP + " (default: none, loopback only)")
    serve.add_argument("--router", choices=("affinity", "pow2"), default="affinity",
                       help="affinity: a document's requests to the replica holding its prefix KV; pow2: Serve's "
                       "power of two choices")  # fmt: skip
    serve.add_argument("--spill-queue", type=int, default=4, help="affinity: a replica with this many requests in "
                       "flight sends new ones to the least loaded")  # fmt: skip
    serve.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    serve.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: bf16 on GPUs, else what the CPU "
                       "computes fastest")  # fmt: skip
    serve.add_argument("--quantize", choices=QUANTIZE, default="auto")
    serve.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                       help="each replica's compiled step, as `canvas-ls engine --compile`")  # fmt: skip
    serve.add_argument("--cpus-per-replica", type=float, default=1.0)
    serve.add_argument("--gpus-per-replica", type=float, default=0.0, help="e.g. 1 for DiffusionGemma on an H100")
    serve.add_argument("--max-batch", type=int, default=MAX_BATCH, help="requests sharing a replica's forwards")
    serve.add_argument("--rate", type=float, default=20.0, help="requests a second per user (on average)")
    serve.add_argument("--burst", type=int, default=40, help="requests per user at once")

    token = actions.add_parser("token", help="add, revoke or list the users of a token file")
    token.add_argument("action", choices=("add", "revoke", "list"))
    token.add_argument("name", nargs="?", help="the user (add, revoke)")
    token.add_argument("--tokens", type=Path, required=True, help=TOKENS_HELP)


def run(args: argparse.Namespace) -> int:
    return _token(args) if args.team_command == "token" else _serve(args)


def _token(args: argparse.Namespace) -> int:
    from ..engine.users import TokenFile, TokenFileError, add_user, revoke_user

    try:
        if args.action == "list":
            users = TokenFile(args.tokens).users if args.tokens.exists() else {}
            print("\n".join(sorted(users)) if users else f"no users in {args.tokens}")
            return 0
        if not args.name:
            raise CliError(f"`team token {args.action}` needs a user name")
        if args.action == "revoke":
            revoke_user(args.tokens, args.name)
            print(f"revoked {args.name}: the deployment refuses its token within a second", file=sys.stderr)
            return 0
        token = add_user(args.tokens, args.name)
    except TokenFileError as exc:
        raise CliError(str(exc)) from exc
    print(f"added {args.name}; its token (shown once, give it to the user for $CANVAS_LS_TOKEN):", file=sys.stderr)
    print(token)
    return 0


def _serve(args: argparse.Namespace) -> int:
    host, port = host_port(args.http)
    try:
        check_host(host, args.allow_remote)
    except ServeError as exc:
        raise CliError(str(exc)) from exc
    if args.tokens is None and not loopback(host):
        raise CliError("a deployment other machines can reach needs --tokens (`canvas-ls team token add`)")
    try:
        import ray
        from ray import serve

        from ..engine.team import APP_NAME, TeamOptions, application
    except ImportError as exc:
        raise CliError(f"the team deployment needs Ray Serve: pip install 'canvas-ls[team]' ({exc})") from exc
    try:
        options = TeamOptions(model=args.model, replicas=args.replicas, device=args.device, dtype=args.dtype,
                              quantize=args.quantize, compile=args.compile, cpus_per_replica=args.cpus_per_replica,
                              gpus_per_replica=args.gpus_per_replica, max_batch=args.max_batch, router=args.router,
                              spill_queue=args.spill_queue, tokens=str(args.tokens.resolve()) if args.tokens else None,
                              rate=args.rate, burst=args.burst)  # fmt: skip
        if args.tokens is not None:
            from ..engine.users import TokenFile

            TokenFile(args.tokens)  # a file that cannot be read is refused now, not by the gateway later
    except ValueError as exc:
        raise CliError(str(exc)) from exc

    try:
        ray.init(address=args.address, include_dashboard=False, logging_level=logging.WARNING,
                 log_to_driver=False)  # fmt: skip
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise CliError(f"no Ray cluster answers at {args.address}: {_last_line(exc)}") from exc
    try:
        serve.start(http_options={"host": host, "port": port})
        started = time.perf_counter()
        serve.run(application(options), name=APP_NAME, route_prefix="/", blocking=False)
    except RuntimeError as exc:  # a replica that cannot load its model: Serve's message ends with its error
        serve.shutdown()
        raise CliError(f"the deployment failed to start: {_last_line(exc)}") from exc
    print(f"canvas-ls team: {args.replicas} replica(s) of {args.model or 'the shipped model'} at "
          f"http://{host}:{port} (router {args.router}{', users from ' + str(args.tokens) if args.tokens else ''}), "
          f"up in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)  # fmt: skip
    try:
        while True:
            time.sleep(3600)
    finally:
        serve.shutdown()


def _last_line(exc: BaseException) -> str:
    """A Ray error's last meaningful line (its message carries the whole remote traceback before it)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
