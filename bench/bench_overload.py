"""A burst past what a replica can serve before the deadline: what admission refuses, and what
those refusals cost (issue 18's target).

    python bench/bench_overload.py                                  # default model, CPU: 500 x (chat, 16 tokens, 30 s)
    python bench/bench_overload.py --shape qwen2.5-1.5b --device cuda    # random weights, a real config
    python bench/bench_overload.py --shape smollm2-135m --tokenizer ../shared/assets/tokenizers/smollm2

Each configuration starts the stack as `llmserve serve` runs it (preprocess, inference on the
default torch backend, gateway; real subprocesses on loopback), warms it up with --warmup-requests
requests at once (so the replica has measured its pace, as a server under traffic has), then sends
--streams GenerateStream requests at once, each a chat of about --prompt-words words asking for
--max-tokens tokens (ignore_eos) with a --deadline-s deadline, one attempt each (with
--follow-hints, as a client that follows retry hints: a refusal carrying a RetryInfo is sent
again after the hint while the deadline from its first attempt leaves time):
  refusing    the defaults: admission refuses at once what its estimate says cannot finish in time;
  admit-all   --no-deadline-admission: no refusal by the estimate (the queue's budgets still
              refuse), the engine ends what its deadline passes; the baseline for what the
              estimate's refusals cost.
Per configuration: requests OK (after a retry), attempts, refused at admission in the end (by
status; with a RetryInfo; the spread of the hints), admitted but ended by their deadline, the
fraction of the window the engine spent in steps (llmserve_inference_step_duration_seconds over
the window / the window; the window: the deadline's, or with --follow-hints from the burst until
its last request ended, so the time refused clients wait for their hints counts), and the burst's TTFT and E2E. Across them: refusals
that would have met their deadline, estimated as max(0, OK with admit-all - OK with refusing), as
a fraction of the refusals. Prints a table and writes JSON to --out-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from google.rpc import error_details_pb2, status_pb2

import bench_stack
from metrics_scrape import sample_totals
import stack_services
from llmserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {"refusing": [], "admit-all": ["--no-deadline-admission"]}
TARGET_BUSY_FRACTION = 0.8
TARGET_FEASIBLE_REFUSALS = 0.05
CHANNELS = 8  # the burst's streams spread over this many connections
DEADLINE_ESTIMATE_REASON = "DEADLINE_ESTIMATE"  # services/inference/finish_estimate.py
WORDS = ("river", "mountain", "quiet", "engine", "orange", "letter", "window", "garden", "silver", "harbor",
         "market", "winter", "signal", "forest", "copper", "planet", "meadow", "ticket", "lantern", "bridge")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_stack.add_served_model_arguments(parser)
    parser.add_argument("--streams", type=int, default=500, help="requests sent at once (default: %(default)s)")
    parser.add_argument("--deadline-s", type=float, default=30.0, help="each request's deadline (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=16, help="(default: %(default)s)")
    parser.add_argument("--prompt-words", type=int, default=400,
                        help="words in each user message, about 1.3 tokens each (default: %(default)s)")
    parser.add_argument("--follow-hints", action="store_true",
                        help="send a refusal with a RetryInfo again after its hint while the deadline leaves time "
                             "(default: one attempt per request)")
    parser.add_argument("--warmup-requests", type=int, default=32, help="(default: %(default)s)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="(default: %(default)s)")
    parser.add_argument("--runs", type=int, default=1,
                        help="run the configs this many times, interleaved, on one model; with 3 or more the "
                             "summary gives min/median/max per config (default: %(default)s)")
    parser.add_argument("--inference-arg", action="append", default=[], metavar="FLAGS",
                        help="flag(s) for the inference service, shell-split, repeatable")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    args.configs = args.configs.split(",")
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown config(s) {unknown}; choose from {', '.join(CONFIGS)}")
    args.inference_arg = [flag for value in args.inference_arg for flag in shlex.split(value)]
    return args


@dataclass
class Outcome:
    """One request of the burst."""

    status: str = "OK"
    refused_at_admission: bool = False
    retry_after_ms: int | None = None
    ttft_s: float | None = None
    e2e_s: float = 0.0
    num_tokens: int = 0
    message: str = ""  # the status message, for a refusal
    num_attempts: int = 0  # refusals with a hint are sent again (send)


@dataclass
class ConfigResult:
    config: str
    num_requests: int
    num_ok: int
    refused_by_status: dict[str, int] = field(default_factory=dict)
    num_refusals_with_retry_info: int = 0
    retry_hints_ms: dict = field(default_factory=dict)
    num_admitted_past_deadline: int = 0
    other_errors: dict[str, int] = field(default_factory=dict)
    busy_fraction: float = 0.0
    ttft_p50_s: float | None = None
    e2e_p50_s: float | None = None
    e2e_max_ok_s: float | None = None
    num_attempts: int = 0  # of all requests, retries after a hint included
    num_ok_after_retry: int = 0
    window_s: float = 0.0  # from the burst until its last request ended
    refusal_examples: list[str] = field(default_factory=list)  # the first, the middle and the last refused
    run: int = 1  # of --runs

    @property
    def num_refused(self) -> int:
        return sum(self.refused_by_status.values())


def start_stack(args, model_dir: Path, inference_flags: list[str], log_dir: Path, metrics_port: int) -> dict:
    return stack_services.start_stack(
        model_dir, log_dir, timeout_s=args.startup_timeout_s,
        inference_flags=["--device", args.device, "--metrics-port", str(metrics_port), *inference_flags, *args.inference_arg])


def step_seconds(metrics_port: int) -> float:
    """The inference engine's time in steps so far (its step-duration histogram's sum)."""
    totals = sample_totals(metrics_port)
    if "llmserve_inference_step_duration_seconds_sum" not in totals:
        raise RuntimeError("no llmserve_inference_step_duration_seconds on the inference metrics endpoint")
    return totals["llmserve_inference_step_duration_seconds_sum"]


def chat_request(index: int, args) -> gateway_pb2.GenerateStreamRequest:
    words = " ".join(WORDS[(index * 7 + i * 3) % len(WORDS)] for i in range(args.prompt_words))
    params = gateway_pb2.GenerateParams(
        return_token_ids=True, sampling=common_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True))
    params.chat.messages.add(role="user", content=f"Request {index}. Summarize these words in one line: {words}")
    return gateway_pb2.GenerateStreamRequest(params=params)


def _details(error: grpc.aio.AioRpcError) -> tuple[bool, int | None]:
    """(refused at admission by its deadline estimate, the RetryInfo delay) from the rich status."""
    status = status_pb2.Status()
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            status.ParseFromString(value)
    is_estimate, retry_after_ms = False, None
    for packed in status.details:
        if packed.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            packed.Unpack(info)
            is_estimate = info.reason == DEADLINE_ESTIMATE_REASON
        elif packed.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            packed.Unpack(info)
            retry_after_ms = info.retry_delay.ToMilliseconds()
    return is_estimate, retry_after_ms


async def send(stub, request, timeout_s: float | None, follow_hints: bool) -> Outcome:
    """One request of the burst, as a client that follows retry hints: a refusal with a
    RetryInfo is sent again after the hint while its deadline (timeout_s from the first attempt)
    leaves time; the outcome is its last attempt's."""
    start, num_attempts = time.monotonic(), 0
    while True:
        time_left_s = None if timeout_s is None else timeout_s - (time.monotonic() - start)
        outcome = await _attempt(stub, request, time_left_s)
        num_attempts += 1
        hint_s = None if outcome.retry_after_ms is None else outcome.retry_after_ms / 1000
        if not follow_hints or not outcome.refused_at_admission or hint_s is None or time_left_s is None \
                or hint_s >= time_left_s:
            break
        await asyncio.sleep(hint_s)
    outcome.num_attempts = num_attempts
    outcome.e2e_s = time.monotonic() - start
    return outcome


async def _attempt(stub, request, timeout_s: float | None) -> Outcome:
    outcome, start = Outcome(), time.monotonic()
    try:
        async for message in stub.GenerateStream(request, timeout=timeout_s):
            if message.token_ids and outcome.ttft_s is None:
                outcome.ttft_s = time.monotonic() - start
            outcome.num_tokens += len(message.token_ids)
    except grpc.aio.AioRpcError as error:
        outcome.status = error.code().name
        outcome.message = error.details() or ""
        is_estimate, outcome.retry_after_ms = _details(error)
        # Refused before it ran: RESOURCE_EXHAUSTED (a budget) or DEADLINE_EXCEEDED with the estimate.
        outcome.refused_at_admission = is_estimate or error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    return outcome


async def send_all(address: str, requests: list, timeout_s: float | None, follow_hints: bool = False) -> list[Outcome]:
    channels = [grpc.aio.insecure_channel(address) for _ in range(CHANNELS)]
    try:
        stubs = [gateway_pb2_grpc.GatewayServiceStub(channel) for channel in channels]
        return await asyncio.gather(*(send(stubs[i % CHANNELS], r, timeout_s, follow_hints) for i, r in enumerate(requests)))
    finally:
        for channel in channels:
            await channel.close()


def summarize(config: str, outcomes: list[Outcome], busy_fraction: float) -> ConfigResult:
    result = ConfigResult(config, len(outcomes), sum(o.status == "OK" for o in outcomes), busy_fraction=busy_fraction)
    hints = []
    for outcome in outcomes:
        if outcome.status == "OK":
            continue
        if outcome.refused_at_admission:
            result.refused_by_status[outcome.status] = result.refused_by_status.get(outcome.status, 0) + 1
            if outcome.retry_after_ms is not None:
                result.num_refusals_with_retry_info += 1
                hints.append(outcome.retry_after_ms)
        elif outcome.status == "DEADLINE_EXCEEDED":
            result.num_admitted_past_deadline += 1
        else:
            result.other_errors[outcome.status] = result.other_errors.get(outcome.status, 0) + 1
    result.num_attempts = sum(o.num_attempts for o in outcomes)
    result.num_ok_after_retry = sum(o.status == "OK" and o.num_attempts > 1 for o in outcomes)
    refused = [o for o in outcomes if o.refused_at_admission]
    if refused:
        result.refusal_examples = [refused[i].message for i in sorted({0, len(refused) // 2, len(refused) - 1})]
    if hints:
        result.retry_hints_ms = {"min": min(hints), "median": statistics.median(hints), "max": max(hints),
                                 "distinct": len(set(hints))}
    ok = [o for o in outcomes if o.status == "OK"]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    result.ttft_p50_s = statistics.median(ttfts) if ttfts else None
    result.e2e_p50_s = statistics.median(o.e2e_s for o in ok) if ok else None
    result.e2e_max_ok_s = max(o.e2e_s for o in ok) if ok else None
    return result


def run_config(config: str, args, model_dir: Path, log_dir: Path) -> ConfigResult:
    metrics_port = stack_services.free_port()
    print(f"[{config}] starting the stack", flush=True)
    services = start_stack(args, model_dir, CONFIGS[config], log_dir / config, metrics_port)
    try:
        address = services["gateway"].address
        warmup = [chat_request(-1 - i, args) for i in range(args.warmup_requests)]
        print(f"[{config}] warm-up: {len(warmup)} requests at once", flush=True)
        asyncio.run(send_all(address, warmup, None))
        burst = [chat_request(i, args) for i in range(args.streams)]
        print(f"[{config}] burst: {len(burst)} requests at once, {args.deadline_s:g} s deadline", flush=True)
        before_s, start = step_seconds(metrics_port), time.monotonic()
        outcomes = asyncio.run(send_all(address, burst, args.deadline_s, args.follow_hints))
        # The deadline's window; following hints, until the last client gave up or finished.
        window_s = time.monotonic() - start if args.follow_hints else max(args.deadline_s, time.monotonic() - start)
        busy_fraction = (step_seconds(metrics_port) - before_s) / window_s
    finally:
        stack_services.stop_services(services)
    result = summarize(config, outcomes, busy_fraction)
    result.window_s = window_s
    print(f"[{config}] {result.num_ok} OK ({result.num_ok_after_retry} after a retry), {result.num_refused} refused, "
          f"{result.num_admitted_past_deadline} admitted past their deadline, {result.num_attempts} attempts, "
          f"busy {busy_fraction:.0%} of {window_s:.1f} s", flush=True)
    return result


def format_table(results: list[ConfigResult]) -> str:
    header = ["config #run", "requests", "OK", "OK after a retry", "attempts", "refused", "with RetryInfo", "hints ms (min/median/max, distinct)",
              "admitted, past deadline", "other errors", "engine busy (window s)", "TTFT p50 s", "E2E p50 s", "E2E max OK s"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for r in results:
        hints = r.retry_hints_ms
        hint_text = f"{hints['min']}/{hints['median']:.0f}/{hints['max']}, {hints['distinct']}" if hints else "-"
        cells = [f"{r.config} #{r.run}", r.num_requests, r.num_ok, r.num_ok_after_retry, r.num_attempts, f"{r.num_refused} {r.refused_by_status}",
                 r.num_refusals_with_retry_info, hint_text, r.num_admitted_past_deadline, r.other_errors or "-",
                 f"{r.busy_fraction:.0%} ({r.window_s:.1f})", _seconds(r.ttft_p50_s), _seconds(r.e2e_p50_s), _seconds(r.e2e_max_ok_s)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


SPREAD_FIELDS = ("num_ok", "num_refused", "num_admitted_past_deadline", "busy_fraction", "window_s")


def spread(results: list[ConfigResult]) -> dict:
    """Min, median and max over a config's runs of each SPREAD_FIELDS number."""
    spreads = {}
    for name in SPREAD_FIELDS:
        values = sorted(getattr(r, name) for r in results)
        spreads[name] = {"min": values[0], "median": statistics.median(values), "max": values[-1]}
    return spreads


def format_spreads(spreads: dict[str, dict]) -> str:
    header = ["config", *(f"{name} min/median/max" for name in SPREAD_FIELDS)]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for config, of_config in spreads.items():
        cells = [config]
        for name in SPREAD_FIELDS:
            values = of_config[name]
            fmt = "{:.0%}" if name == "busy_fraction" else "{:.1f}" if name == "window_s" else "{:g}"
            cells.append("/".join(fmt.format(values[key]) for key in ("min", "median", "max")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def feasible_refusals(results: dict[str, ConfigResult]) -> dict | None:
    """Refusals that would have met their deadline: what admit-all served beyond refusing's OK."""
    if not {"refusing", "admit-all"} <= results.keys():
        return None
    refusing, admit_all = results["refusing"], results["admit-all"]
    num = max(0, admit_all.num_ok - refusing.num_ok)
    fraction = num / refusing.num_refused if refusing.num_refused else 0.0
    return {"num": num, "fraction_of_refusals": fraction, "target": TARGET_FEASIBLE_REFUSALS}


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-overload-") as log_dir:
        args.model = bench_stack.served_model(args, Path(log_dir))
        for run in range(1, args.runs + 1):
            for config in args.configs:
                result = run_config(config, args, args.model, Path(log_dir))
                result.run = run
                results[(run, config)] = result
    runs = [{config: results[(run, config)] for config in args.configs} for run in range(1, args.runs + 1)]
    feasible = [feasible_refusals(of_run) for of_run in runs]
    print()
    print(format_table(list(results.values())))
    for run, of_run in enumerate(feasible, 1):
        if of_run is not None:
            print(f"run {run}: refusals that would have met their deadline: {of_run['num']} "
                  f"({of_run['fraction_of_refusals']:.1%} of the refusals; target <= {TARGET_FEASIBLE_REFUSALS:.0%})")
    spreads = {config: spread([results[(run, config)] for run in range(1, args.runs + 1)]) for config in args.configs}
    if args.runs >= 3:
        print()
        print(format_spreads(spreads))
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    report = {"settings": settings,
              "results": [{**asdict(r), "num_refused": r.num_refused} for r in results.values()],
              "feasible_refusals": feasible, "spread": spreads, "target_busy_fraction": TARGET_BUSY_FRACTION}
    path = args.out_dir / f"overload-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
