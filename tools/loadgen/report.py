"""The benchmark's outputs: a table on stdout, one JSON file, and PNG plots (latency CDFs,
throughput and requests in flight over time)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO

from llmserve.tools.loadgen.client import RequestRecord
from llmserve.tools.loadgen.stats import PERCENTILES, latency_samples_ms

_LATENCIES = (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms"), ("Queue", "queue_ms"))


def format_table(summary: dict) -> str:
    lines = [
        f"requests     {summary['num_succeeded']}/{summary['num_requests']} succeeded in {summary['duration_s']:.2f} s"
        + (f"; errors: {_errors(summary['errors_by_status'])}" if summary["errors_by_status"] else ""),
        f"throughput   {summary['output_tokens_per_s']:.1f} output tok/s, {summary['total_tokens_per_s']:.1f} total tok/s, "
        f"{summary['request_rate_per_s']:.2f} req/s",
        f"tokens       prompt {summary['num_prompt_tokens']}, completion {summary['num_completion_tokens']}, "
        f"cached {summary['num_cached_tokens']}",
        "latency (ms) " + "".join(f"{'p' + str(p):>10}" for p in PERCENTILES) + f"{'mean':>10}",
    ]
    for label, key in _LATENCIES:
        values = summary[key]
        lines.append(f"  {label:<11}" + "".join(_cell(values[f"p{p}"]) for p in PERCENTILES) + _cell(values["mean"]))
    by_worker = summary.get("completion_tokens_by_worker", {})
    if len(by_worker) > 1:  # a gateway of several --workers: how the calls spread over them
        spread = max(by_worker.values()) / max(1, min(by_worker.values()))
        lines.append("workers      " + ", ".join(f"{worker}: {tokens}" for worker, tokens in by_worker.items())
                     + f" completion tokens (max / min {spread:.2f})")
    for error in summary["first_errors"]:
        lines.append(f"  error: {error}")
    return "\n".join(lines)


def _cell(value: float) -> str:
    return f"{'-':>10}" if math.isnan(value) else f"{value:>10.2f}"


def _errors(errors_by_status: dict) -> str:
    return ", ".join(f"{status} x{count}" for status, count in sorted(errors_by_status.items()))


def write_json(path: Path, report: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(finite(report), indent=2, allow_nan=False) + "\n")
    return path


def finite(report):
    """NaN (no samples) becomes None, so the JSON is strict."""
    if isinstance(report, dict):
        return {key: finite(value) for key, value in report.items()}
    if isinstance(report, list):
        return [finite(value) for value in report]
    if isinstance(report, float) and not math.isfinite(report):
        return None
    return report


def write_plots(out_dir: Path, stem: str, records: list[RequestRecord], timeline: dict) -> list[Path]:
    """`<stem>-latency.png` (CDFs of TTFT, ITL and E2E) and `<stem>-throughput.png`."""
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("llmserve bench: plots need matplotlib: pip install 'llmserve[bench]', or pass --no-plots") from exc
    matplotlib.use("Agg")  # files only, never a window
    from matplotlib import pyplot as plt

    samples = latency_samples_ms(records)
    series = {"TTFT": samples["ttft_ms"], "ITL": samples["itl_ms"], "E2E": samples["e2e_ms"]}
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for axis, (label, values) in zip(axes, series.items()):
        ordered = sorted(values)
        axis.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post")
        axis.set(title=f"{label} CDF", xlabel=f"{label} (ms)", ylabel="fraction of samples", ylim=(0, 1.02))
        axis.grid(alpha=0.3)
    figure.tight_layout()
    latency_path = out_dir / f"{stem}-latency.png"
    figure.savefig(latency_path, dpi=110)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(9, 3.8))
    axis.plot(timeline["time_s"], timeline["output_tokens_per_s"], label="output tok/s")
    axis.set(xlabel="time since start (s)", ylabel="output tokens / s", title="Throughput over time")
    axis.grid(alpha=0.3)
    other = axis.twinx()
    other.plot(timeline["time_s"], timeline["requests_in_flight"], color="tab:orange", label="requests in flight")
    other.set_ylabel("requests in flight")
    lines = axis.get_lines() + other.get_lines()
    axis.legend(lines, [line.get_label() for line in lines], loc="lower center")
    figure.tight_layout()
    throughput_path = out_dir / f"{stem}-throughput.png"
    figure.savefig(throughput_path, dpi=110)
    plt.close(figure)
    return [latency_path, throughput_path]


def client_usage(cpu_s: float, summary: dict) -> dict:
    """The client processes' CPU over the run: a client near one core per process is what a run
    measured, not the server."""
    num_tokens = summary["num_completion_tokens"]
    return {
        "cpu_s": cpu_s,
        "cpu_cores": cpu_s / summary["duration_s"],  # mean cores busy over the run
        "cpu_us_per_output_token": cpu_s * 1e6 / num_tokens if num_tokens else math.nan,
    }


def print_table(summary: dict, out: IO[str], client: dict | None = None) -> None:
    print(format_table(summary), file=out)
    if client is not None:
        print(f"client       {client['cpu_s']:.2f} s CPU ({client['cpu_cores']:.2f} cores busy), "
              f"{client['cpu_us_per_output_token']:.1f} us per output token", file=out)
