"""`llmserve bench`: the load generator, against a running gateway.

    llmserve bench --num-requests 200 --concurrency 32 --prompt-tokens 512 --output-tokens 128
    llmserve bench --request-rate 8 --prompt-tokens uniform:128:1024 --prefix-groups 4 --prefix-tokens 256 --chat
    llmserve bench --token-ids --prompt-tokens 512 --output-tokens 512 --concurrency 256
    llmserve bench --prefix-groups 4 --prefix-tokens 1024 --turns 4 --prompt-tokens 128 --chat
    llmserve bench --http --chat --concurrency 32        # the OpenAI HTTP API (http://127.0.0.1:8000/v1)
    llmserve bench --http http://host:8000/v1 --token-ids  # any OpenAI-compatible server's /v1/completions
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from llmserve.tools.loadgen import openai_client
from llmserve.tools.loadgen.report import client_usage, print_table, write_json, write_plots
from llmserve.tools.loadgen.runner import RunConfig, run_workload
from llmserve.tools.loadgen.stats import summarize, timeline
from llmserve.tools.loadgen.workload import LengthDistribution, PromptBuilder, PromptForm, WorkloadConfig, plan_requests

DEFAULT_OUT_DIR = Path("bench/results")


def add_bench_parser(commands, add_client_options) -> None:
    p = commands.add_parser(
        "bench",
        help="load-test a running gateway (gRPC or OpenAI HTTP): latency percentiles, throughput, errors, plots",
        description="Send a seeded workload to the gateway's streaming RPC (or, with --http, to an "
        "OpenAI-compatible server's streaming chat/completions endpoints) from one or more client "
        "processes: a fixed number of requests in flight (--concurrency) or Poisson arrivals "
        "(--request-rate). Prints a table (TTFT, inter-token latency, time per output token and "
        "end-to-end latency at p50/p90/p99; output and total tok/s; errors by gRPC status, or HTTP_<status> over HTTP; the client "
        "processes' own CPU) and writes JSON plus PNG plots (latency CDFs, throughput over time) to --out-dir. Sampling is greedy with "
        "ignore_eos, so each request generates exactly its --output-tokens.",
    )
    add_client_options(p)
    p.add_argument("--model", default="", metavar="NAME", help="model name (default: the gateway's only model; "
                   "with --http, the first one GET /v1/models lists)")
    p.add_argument("--http", nargs="?", const=openai_client.DEFAULT_BASE_URL, metavar="BASE_URL",
                   help="send to the OpenAI HTTP API at BASE_URL instead of --address's gRPC "
                   "(default BASE_URL: %(const)s): --chat to /chat/completions, text and --token-ids "
                   "prompts to /completions, streamed with usage; a chunk with content counts as one "
                   "token in ITL (OpenAI chunks carry no token count)")
    load = p.add_argument_group("load")
    load.add_argument("--num-requests", type=_positive_int, default=100, metavar="N", help="requests to send (default: %(default)s)")
    load.add_argument("--concurrency", type=_positive_int, default=16, metavar="N",
                      help="most requests in flight; with --request-rate, a cap (default: %(default)s)")
    load.add_argument("--request-rate", type=float, metavar="PER_S",
                      help="Poisson arrivals at this mean rate instead of a closed loop")
    load.add_argument("--client-processes", type=_positive_int, default=1, metavar="N",
                      help="client processes sharing the load, so the client is never the bottleneck (default: %(default)s)")
    load.add_argument("--connections-per-client", type=_positive_int, default=1, metavar="N",
                      help="connections each client process spreads its requests over: a gateway with several "
                      "--workers is balanced by connection, not by request, unless --address lists their --worker-ports "
                      "(default: %(default)s)")
    shape = p.add_argument_group("requests")
    shape.add_argument("--prompt-tokens", type=LengthDistribution.parse, default=LengthDistribution.parse("256"),
                       metavar="LEN", help="prompt length: N, uniform:LOW:HIGH or normal:MEAN:STDDEV (default: 256)")
    shape.add_argument("--output-tokens", type=LengthDistribution.parse, default=LengthDistribution.parse("64"),
                       metavar="LEN", help="tokens to generate, same forms (default: 64)")
    shape.add_argument("--prefix-groups", type=int, default=0, metavar="G",
                       help="G shared prefixes; each request starts with one of them (default: none)")
    shape.add_argument("--prefix-tokens", type=int, default=0, metavar="N", help="tokens in each shared prefix")
    shape.add_argument("--turns", type=_positive_int, default=1, metavar="T",
                       help="conversations of T turns: each turn's prompt is the conversation so far (earlier "
                       "turns and the answers the server gave) plus a new --prompt-tokens message; "
                       "--num-requests counts turns (default: %(default)s)")
    form = shape.add_mutually_exclusive_group()
    form.add_argument("--chat", dest="prompt_form", action="store_const", const=PromptForm.CHAT,
                      default=PromptForm.TEXT, help="send chat turns (the shared prefix as the system turn)")
    form.add_argument("--token-ids", dest="prompt_form", action="store_const", const=PromptForm.TOKEN_IDS,
                      help="send the prompts as token ids (GenerateParams.prompt_token_ids): exactly the asked "
                      "lengths, no special tokens added, no tokenizing in preprocess")
    shape.add_argument("--allow-eos", action="store_true", help="let requests stop at EOS (output lengths then vary)")
    shape.add_argument("--tokenizer", metavar="PATH",
                       help="tokenizer.json or a model directory to build prompts with (default: the default model's)")
    shape.add_argument("--seed", type=int, default=0, help="workload seed: same seed, same requests (default: %(default)s)")
    out = p.add_argument_group("output")
    out.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="where JSON and plots go (default: %(default)s)")
    out.add_argument("--name", default="", help="file name stem (default: bench-<timestamp>)")
    out.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run_bench)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def workload_from_args(args: argparse.Namespace) -> WorkloadConfig:
    if args.prefix_groups and args.prefix_tokens < 1:
        raise SystemExit("llmserve bench: --prefix-groups needs --prefix-tokens >= 1")
    if args.http and args.turns > 1 and args.prompt_form is PromptForm.TOKEN_IDS:
        # The next turn's prompt holds the answer's token ids, which an OpenAI stream does not carry.
        raise SystemExit("llmserve bench: --http --turns needs text or --chat prompts, not --token-ids")
    return WorkloadConfig(
        num_requests=args.num_requests, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
        seed=args.seed, request_rate=args.request_rate, num_prefix_groups=args.prefix_groups,
        prefix_tokens=args.prefix_tokens if args.prefix_groups else 0, prompt_form=args.prompt_form,
        num_turns=args.turns,
    )


def _tokenizer_path(spec: str | None) -> Path:
    if spec:
        return Path(spec).expanduser()
    from llmserve.tools.model_store import resolve_model

    return resolve_model(None)


def run_bench(args: argparse.Namespace) -> int:
    workload = workload_from_args(args)
    planned = plan_requests(workload, PromptBuilder.from_path(_tokenizer_path(args.tokenizer)))
    config = RunConfig(
        address=args.http or args.address, concurrency=args.concurrency, num_client_processes=args.client_processes,
        connections_per_client=args.connections_per_client,
        timeout_s=args.timeout_s or 600.0, ignore_eos=not args.allow_eos, model=_model(args),
        show_progress=not args.no_progress and sys.stderr.isatty(),
        **({"send": openai_client.send_one, "connect": openai_client.connect} if args.http else {}),
    )
    result = run_workload(planned, workload, config)
    summary = summarize(result.records, result.start_s, result.end_s)
    over_time = timeline(result.records, result.start_s, result.end_s)
    client = client_usage(result.client_cpu_s, summary)
    print_table(summary, sys.stdout, client)
    stem = args.name or time.strftime("bench-%Y%m%d-%H%M%S")
    report = {"config": _config_dict(config, args, workload), "summary": summary, "client": client, "timeline": over_time}
    path = write_json(args.out_dir / f"{stem}.json", report)
    written = [path] if args.no_plots else [path, *write_plots(args.out_dir, stem, result.records, over_time)]
    print("wrote " + ", ".join(map(str, written)), file=sys.stdout)
    return 0 if summary["num_succeeded"] == summary["num_requests"] else 1


def _model(args: argparse.Namespace) -> str:
    """--model; over HTTP, where a request must name one, else the first the server lists."""
    if args.model or not args.http:
        return args.model
    return openai_client.served_model(args.http)


def _config_dict(config: RunConfig, args: argparse.Namespace, workload: WorkloadConfig) -> dict:
    return {
        "api": "openai-http" if args.http else "grpc", "address": config.address, "model": config.model,
        "num_requests": workload.num_requests, "concurrency": args.concurrency,
        "request_rate": workload.request_rate, "client_processes": args.client_processes,
        "connections_per_client": args.connections_per_client, "prompt_tokens": str(workload.prompt_tokens),
        "output_tokens": str(workload.output_tokens), "prefix_groups": workload.num_prefix_groups,
        "prefix_tokens": workload.prefix_tokens, "prompt_form": workload.prompt_form.value,
        "seed": workload.seed, "ignore_eos": not args.allow_eos, "turns": workload.num_turns,
    }
