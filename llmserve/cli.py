"""The `llmserve` command: run the services, talk to them, fetch the model.

    llmserve serve                           # default model on 127.0.0.1:50051
    llmserve chat "Hello! Who are you?"      # streams the answer
    llmserve generate "The capital of France is" --max-tokens 16 --temperature 0
    llmserve models
    llmserve fetch-model                     # download and convert the default model only

The client commands stream text to stdout as it arrives and print one usage line on stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from llmserve.inference.kernel_args import add_kernel_arguments
from llmserve.loadgen.command import add_bench_parser

if TYPE_CHECKING:
    from llmserve.launcher import ServeConfig

DEFAULT_ADDRESS = "127.0.0.1:50051"
ADDRESS_ENV = "LLMSERVE_ADDRESS"
EXIT_RPC_ERROR = 1
EXIT_INTERRUPTED = 130


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
        "loopback ports, then the gateway on --host:--port. Logs of all three go to stderr; the "
        "first stdout line is 'gateway listening on HOST:PORT'. Ctrl-C or SIGTERM stops them "
        "(gateway first); a second Ctrl-C does not wait for in-flight requests.",
    )
    p.add_argument(
        "--model", default="default", metavar="default|DIR|FILE.gguf",
        help="'default' (SmolLM2-135M-Instruct, fetched and converted on first use), an HF checkpoint "
        "directory or a .gguf file (default: %(default)s)",
    )
    p.add_argument("--model-name", metavar="NAME", help="name clients use for the model (default: the model's own)")
    p.add_argument(
        "--cache-dir", type=Path, metavar="DIR",
        help="where converted models are kept (default: $LLMSERVE_CACHE_DIR or ~/.cache/llmserve)",
    )
    p.add_argument(
        "--backend", choices=("torch", "hf", "trtllm"), default="torch",
        help="inference engine: torch (ours; falls back to hf if not installed), hf (transformers) "
        "or trtllm (default: %(default)s)",
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"),
        help="weight/activation dtype (default: float32 on cpu, bfloat16 on cuda)",
    )
    p.add_argument(
        "--host", default="127.0.0.1",
        help="gateway bind address; 0.0.0.0 accepts remote clients (default: %(default)s)",
    )
    p.add_argument("--port", type=int, default=50051, help="gateway port; 0 picks a free one (default: %(default)s)")
    p.add_argument("--num-kv-blocks", type=int, metavar="N", help="KV cache size in blocks (default: from memory)")
    p.add_argument("--max-num-seqs", type=int, metavar="N", help="sequences running at once (default: the engine's)")
    p.add_argument(
        "--max-output-tokens", type=int, metavar="TOKENS",
        help="largest max_tokens accepted (default: preprocess's, 4096)",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse the KV cache of shared prefixes")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: skip CUDA-graph capture")
    p.add_argument(
        "--no-async-scheduling", action="store_true",
        help="run engine steps one at a time instead of overlapping the next step's CPU work with "
        "the device's compute (slower on CUDA, simpler to debug)",
    )
    add_kernel_arguments(p)  # passed to the inference service as is
    p.add_argument(
        "--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="log level of the launcher and all services (default: %(default)s)",
    )
    p.add_argument(
        "--grace-period-s", type=float, default=10.0, metavar="SECONDS",
        help="on stop, how long in-flight requests may finish (default: %(default)s)",
    )
    p.add_argument(
        "--startup-timeout-s", type=float, default=900.0, metavar="SECONDS",
        help="how long each service may take to become ready (default: %(default)s)",
    )
    p.set_defaults(handler=_run_serve)


def _add_client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address", default=os.environ.get(ADDRESS_ENV, DEFAULT_ADDRESS),
        help=f"gateway HOST:PORT (default: ${ADDRESS_ENV} or {DEFAULT_ADDRESS})",
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
    p = commands.add_parser(
        "chat", help="send one chat message and stream the answer",
        description="Send MESSAGE as a user turn (rendered with the model's chat template) and stream "
        "the reply to stdout; a usage line goes to stderr.",
    )
    p.add_argument("message", help="the user message")
    p.add_argument("--system", default=None, help="system prompt")
    _add_client_options(p)
    _add_sampling_options(p)
    p.set_defaults(handler=_run_chat)


def _add_generate(commands) -> None:
    p = commands.add_parser(
        "generate", help="complete a raw prompt and stream the text",
        description="Complete PROMPT as is (no chat template) and stream the text to stdout; a usage "
        "line goes to stderr.",
    )
    p.add_argument("prompt", help="the prompt text")
    _add_client_options(p)
    _add_sampling_options(p)
    p.set_defaults(handler=_run_generate)


def _add_models(commands) -> None:
    p = commands.add_parser("models", help="list the models behind a gateway")
    _add_client_options(p)
    p.set_defaults(handler=_run_models)


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
    from llmserve.launcher import serve

    return serve(serve_config_from_args(args))


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The launcher's ServeConfig for parsed `llmserve serve` flags."""
    from llmserve.launcher import ServeConfig

    return ServeConfig(
        model=args.model,
        model_name=args.model_name,
        cache_dir=args.cache_dir,
        backend=args.backend,
        device=args.device,
        dtype=args.dtype,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        grace_period_s=args.grace_period_s,
        startup_timeout_s=args.startup_timeout_s,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_output_tokens=args.max_output_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        enforce_eager=args.enforce_eager,
        attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        async_scheduling=not args.no_async_scheduling,
    )


def _run_fetch_model(args: argparse.Namespace) -> int:
    from llmserve.model_store import ModelResolutionError, resolve_model

    try:
        path = resolve_model(args.model, cache_dir=args.cache_dir, progress=True)
    except ModelResolutionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _sampling_pb(args: argparse.Namespace):
    from llmserve.v1 import common_pb2

    sampling = common_pb2.SamplingParams(stop=args.stop, ignore_eos=args.ignore_eos)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(sampling, name, value)
    return sampling


def _run_chat(args: argparse.Namespace) -> int:
    from llmserve.v1 import common_pb2, gateway_pb2

    messages = []
    if args.system is not None:
        messages.append(common_pb2.ChatMessage(role="system", content=args.system))
    messages.append(common_pb2.ChatMessage(role="user", content=args.message))
    request = gateway_pb2.GenerateRequest(
        model=args.model, chat=common_pb2.ChatInput(messages=messages), sampling=_sampling_pb(args)
    )
    return _stream_to_terminal(args, request)


def _run_generate(args: argparse.Namespace) -> int:
    from llmserve.v1 import gateway_pb2

    request = gateway_pb2.GenerateRequest(model=args.model, prompt=args.prompt, sampling=_sampling_pb(args))
    return _stream_to_terminal(args, request)


def _stream_to_terminal(args: argparse.Namespace, request) -> int:
    """Write text deltas to stdout as they arrive (then a newline); usage on stderr."""
    import grpc

    from llmserve.v1 import gateway_pb2_grpc

    with _channel(args.address) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).GenerateStream(request, timeout=args.timeout_s)
        last = None
        has_text = False
        try:
            for response in call:
                sys.stdout.write(response.text)
                sys.stdout.flush()
                has_text = has_text or bool(response.text)
                last = response
        except grpc.RpcError as error:
            _end_line(has_text)
            return _report_rpc_error(error, args.address)
        except KeyboardInterrupt:
            call.cancel()  # the gateway aborts the request and frees its KV cache
            _end_line(has_text)
            return EXIT_INTERRUPTED
    sys.stdout.write("\n")
    sys.stdout.flush()
    if last is not None:
        print(_usage_line(last), file=sys.stderr)
    return 0


def _end_line(has_text: bool) -> None:
    if has_text:
        sys.stdout.write("\n")
        sys.stdout.flush()


def _usage_line(response) -> str:
    from llmserve.v1 import common_pb2

    finish = common_pb2.FinishReason.Name(response.finish_reason).removeprefix("FINISH_REASON_").lower()
    if response.HasField("matched_stop"):
        finish += f" ({response.matched_stop!r})"
    usage, timings = response.usage, response.timings
    return (
        f"[{response.request_id}] finish: {finish} | tokens: prompt {usage.prompt_tokens}, "
        f"completion {usage.completion_tokens}, cached {usage.cached_tokens} | "
        f"ttft {timings.time_to_first_token_ns / 1e6:.0f} ms, total {timings.total_time_ns / 1e6:.0f} ms"
    )


def _run_models(args: argparse.Namespace) -> int:
    import grpc

    from llmserve.v1 import gateway_pb2, gateway_pb2_grpc

    with _channel(args.address) as channel:
        try:
            response = gateway_pb2_grpc.GatewayStub(channel).ListModels(
                gateway_pb2.ListModelsRequest(), timeout=args.timeout_s
            )
        except grpc.RpcError as error:
            return _report_rpc_error(error, args.address)
    for card in response.models:
        print(f"{card.id}\t{card.architecture}\tcontext {card.max_context_tokens} tokens\tbackend {card.backend}")
    return 0


def _channel(address: str):
    import grpc

    from llmserve.server import CHANNEL_OPTIONS

    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def _report_rpc_error(error, address: str) -> int:
    import grpc

    code = error.code()
    print(f"error: {code.name}: {error.details()}", file=sys.stderr)
    if code == grpc.StatusCode.UNAVAILABLE:
        print(f"hint: is `llmserve serve` running and reachable at {address}?", file=sys.stderr)
    return EXIT_RPC_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "INFO"),
        format="%(asctime)s %(levelname)s launcher %(name)s: %(message)s",
    )
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
