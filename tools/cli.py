"""The `llmserve` command: run the services, talk to them, fetch the model.

    llmserve serve                           # default model on 127.0.0.1:50051
    llmserve chat "Hello! Who are you?"      # streams the answer
    llmserve generate "The capital of France is" --max-tokens 16 --temperature 0
    llmserve models
    llmserve fetch-model                     # download and convert the default model only

The parser is here; the client commands (chat, generate, models) are in llmserve.tools.client, `serve`
in llmserve.tools.launcher (its flags in llmserve.tools.serve_config).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Sequence

from llmserve.tools import client
from llmserve.tools.loadgen.command import add_bench_parser
from llmserve.tools.serve_config import add_serve_arguments, serve_config_from_args
from llmserve.server_flags import DEFAULT_HOST, GATEWAY_PORT

DEFAULT_ADDRESS = f"{DEFAULT_HOST}:{GATEWAY_PORT}"
ADDRESS_ENV = "LLMSERVE_ADDRESS"


# ---------------------------------------------------------------------------------------------
# Parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmserve",
        description="LLM serving as three gRPC services (gateway → preprocess → inference). "
        "Start them with `llmserve serve`, then talk to the gateway with `chat`, `generate` or `models`.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(commands)
    _add_chat(commands)
    _add_generate(commands)
    _add_models(commands)
    _add_fetch_model(commands)
    add_bench_parser(commands, _add_client_options)
    return parser


def _add_serve(commands) -> None:
    p = commands.add_parser(
        "serve",
        help="run preprocess, inference and the gateway locally",
        description="Resolve the model, start preprocess and inference as child processes on free "
        "loopback ports, then the gateway on --host:--port. Engine flags are the inference "
        "service's (`python -m llmserve.inference --help`) and are passed on to it. Logs of all "
        "three go to stderr; the first stdout line is 'gateway listening on HOST:PORT'. Ctrl-C or "
        "SIGTERM stops them (gateway first); a second Ctrl-C does not wait for in-flight requests.",
    )
    add_serve_arguments(p)
    p.set_defaults(handler=_run_serve)


def _add_client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address", default=os.environ.get(ADDRESS_ENV, DEFAULT_ADDRESS),
        help=f"gateway HOST:PORT; ipv4:IP:P0,IP:P1,... (a gateway's --worker-ports) or dns:///NAME:PORT (every "
        f"address NAME resolves to, e.g. the chart's gateway-pods Service) spread calls over them with round_robin "
        f"(default: ${ADDRESS_ENV} or {DEFAULT_ADDRESS})",
    )
    p.add_argument(
        "--timeout-s", type=float, metavar="SECONDS", help="deadline for the whole request (default: none)"
    )


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (unset: the server's default)")
    g.add_argument("--max-tokens", type=int, default=None, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 1.0)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default 1.0)")
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (default: no limit)")
    g.add_argument("--seed", type=int, default=None, help="same seed and prompt → same output")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop at this text (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")
    p.add_argument("--model", default="", metavar="NAME", help="model name (default: the gateway's only model)")


def _add_chat(commands) -> None:
    p = _add_prompt_command(
        commands, "chat", ("message", "the user message"), client.run_chat,
        help="send one chat message and stream the answer",
        description="Send MESSAGE as a user turn (rendered with the model's chat template) and stream "
        "the reply to stdout; a usage line goes to stderr.",
    )
    p.add_argument("--system", default=None, help="system prompt")


def _add_generate(commands) -> None:
    _add_prompt_command(
        commands, "generate", ("prompt", "the prompt text"), client.run_generate,
        help="complete a raw prompt and stream the text",
        description="Complete PROMPT as is (no chat template) and stream the text to stdout; a usage "
        "line goes to stderr.",
    )


def _add_prompt_command(
    commands, name: str, prompt: tuple[str, str], handler, *, help: str, description: str
) -> argparse.ArgumentParser:
    """A command that sends one prompt to a gateway and streams what comes back (chat,
    generate): the prompt's positional argument (name, help), the client and sampling options."""
    p = commands.add_parser(name, help=help, description=description)
    p.add_argument(prompt[0], help=prompt[1])
    _add_client_options(p)
    _add_sampling_options(p)
    p.set_defaults(handler=handler)
    return p


def _add_models(commands) -> None:
    p = commands.add_parser("models", help="list the models behind a gateway")
    _add_client_options(p)
    p.set_defaults(handler=client.run_models)


def _add_fetch_model(commands) -> None:
    p = commands.add_parser(
        "fetch-model", help="download and convert a model without serving it",
        description="Resolve --model to a local HF checkpoint (fetching and converting the default "
        "model on first use) and print its directory.",
    )
    p.add_argument("--model", default="default", help="'default', a checkpoint directory or a .gguf file")
    p.add_argument("--cache-dir", type=Path, default=None, help="where converted models are kept")
    p.set_defaults(handler=_run_fetch_model)


# ---------------------------------------------------------------------------------------------
# Commands


def _run_serve(args: argparse.Namespace) -> int:
    from llmserve.tools.launcher import serve

    try:
        config = serve_config_from_args(args)
    except ValueError as error:  # flags that parse but do not fit together: argparse's usage error
        print(f"llmserve serve: error: {error}", file=sys.stderr)
        return 2
    return serve(config)


def _run_fetch_model(args: argparse.Namespace) -> int:
    from llmserve.tools.model_store import ModelResolutionError, resolve_model

    try:
        path = resolve_model(args.model, cache_dir=args.cache_dir, progress=True)
    except ModelResolutionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO"),
        format="%(asctime)s %(levelname)s launcher %(name)s: %(message)s",
    )
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
