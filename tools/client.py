"""The client commands: `llmserve chat`, `generate` and `models` against a running gateway.

They stream text to stdout as it arrives and print one usage line on stderr; an RPC error is
one line on stderr (with a hint when the gateway is unreachable) and exit status 1.
"""

from __future__ import annotations

import argparse
import sys

EXIT_RPC_ERROR = 1
EXIT_INTERRUPTED = 130


def _sampling_pb(args: argparse.Namespace):
    from llmserve.v1 import common_pb2

    sampling = common_pb2.SamplingParams(stop=args.stop, ignore_eos=args.ignore_eos)
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(sampling, name, value)
    return sampling


def run_chat(args: argparse.Namespace) -> int:
    from llmserve.v1 import common_pb2, gateway_pb2

    messages = []
    if args.system is not None:
        messages.append(common_pb2.ChatMessage(role="system", content=args.system))
    messages.append(common_pb2.ChatMessage(role="user", content=args.message))
    params = gateway_pb2.GenerateParams(
        model=args.model, chat=common_pb2.ChatInput(messages=messages), sampling=_sampling_pb(args)
    )
    return _stream_to_terminal(args, params)


def run_generate(args: argparse.Namespace) -> int:
    from llmserve.v1 import gateway_pb2

    params = gateway_pb2.GenerateParams(model=args.model, prompt=args.prompt, sampling=_sampling_pb(args))
    return _stream_to_terminal(args, params)


def _stream_to_terminal(args: argparse.Namespace, params) -> int:
    """Write text deltas to stdout as they arrive (then a newline); usage on stderr."""
    import grpc

    from llmserve.v1 import gateway_pb2, gateway_pb2_grpc

    request = gateway_pb2.GenerateStreamRequest(params=params)
    with _channel(args.address) as channel:
        call = gateway_pb2_grpc.GatewayServiceStub(channel).GenerateStream(request, timeout=args.timeout_s)
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

    result = response.result
    finish = common_pb2.FinishReason.Name(result.finish_reason).removeprefix("FINISH_REASON_").lower()
    if result.HasField("matched_stop"):
        finish += f" ({result.matched_stop!r})"
    usage, timings = result.usage, result.timings
    return (
        f"[{response.request_id}] finish: {finish} | tokens: prompt {usage.prompt_tokens}, "
        f"completion {usage.completion_tokens}, cached {usage.cached_tokens} | "
        f"ttft {timings.time_to_first_token_ns / 1e6:.0f} ms, total {timings.total_time_ns / 1e6:.0f} ms"
    )


def run_models(args: argparse.Namespace) -> int:
    import grpc

    from llmserve.v1 import gateway_pb2, gateway_pb2_grpc

    with _channel(args.address) as channel:
        try:
            response = gateway_pb2_grpc.GatewayServiceStub(channel).ListModels(
                gateway_pb2.ListModelsRequest(), timeout=args.timeout_s
            )
        except grpc.RpcError as error:
            return _report_rpc_error(error, args.address)
    for model in response.models:
        print(f"{model.model_name}\t{model.architecture}\tcontext {model.max_context_tokens} tokens\tbackend {model.backend}")
    return 0


def _channel(address: str):
    import grpc

    from llmserve.call_balancing import balancing_options
    from llmserve.server import CHANNEL_OPTIONS

    return grpc.insecure_channel(address, options=(*CHANNEL_OPTIONS, *balancing_options(address)))


def _report_rpc_error(error, address: str) -> int:
    import grpc

    code = error.code()
    print(f"error: {code.name}: {error.details()}", file=sys.stderr)
    if code == grpc.StatusCode.UNAVAILABLE:
        print(f"hint: is `llmserve serve` running and reachable at {address}?", file=sys.stderr)
    return EXIT_RPC_ERROR
