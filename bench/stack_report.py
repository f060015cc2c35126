"""bench_stack.py's results: one row per (path, streams, repeat), ratios to the engine core loop, a
markdown table and the busiest threads on stdout, JSON (rewritten after every path), a PNG."""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

import engine_steps

BASELINE = "core"
ROLES = ("bench", "engine-core", "inference", "preprocess", "gateway")  # the processes a row may have


def significant(value: float | None, digits: int = 4) -> float | None:
    """`value` rounded to `digits` significant digits (bench_gpu.significant: a rate never
    rounds to zero); None and NaN (no samples) become None."""
    if value is None or not math.isfinite(value):
        return None
    if value == 0:
        return 0.0
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def measurement(summary: dict, usage: dict[str, dict]) -> dict:
    """The row fields of one cell, from loadgen's summary and proc_cpu's usage per role."""
    num_ok = max(1, summary["num_succeeded"])
    return {
        "num_requests": summary["num_requests"],
        "num_succeeded": summary["num_succeeded"],
        "errors_by_status": summary["errors_by_status"],
        "duration_s": significant(summary["duration_s"]),
        "output_tokens_per_s": significant(summary["output_tokens_per_s"]),
        "ttft_p50_ms": significant(summary["ttft_ms"]["p50"]),
        "ttft_p99_ms": significant(summary["ttft_ms"]["p99"]),
        "ttft_mean_ms": significant(summary["ttft_ms"]["mean"]),
        # The engine's own wait before each request's first step, as it reported it: the same
        # measure on every path (the core loop's outputs, the replica's Timings).
        "queue_mean_ms": significant(summary["queue_ms"]["mean"]),
        "queue_p99_ms": significant(summary["queue_ms"]["p99"]),
        "itl_p50_ms": significant(summary["itl_ms"]["p50"]),
        "itl_p99_ms": significant(summary["itl_ms"]["p99"]),
        "prompt_tokens_per_request": significant(summary["num_prompt_tokens"] / num_ok),
        "completion_tokens_per_request": significant(summary["num_completion_tokens"] / num_ok),
        # > 1: the stack merged steps into fewer messages (a reader behind, or a server behind)
        "tokens_per_message": significant(summary["num_completion_tokens"] / max(1, summary["num_messages"])),
        "cpu_pct": {role: significant(u["cpu_pct"], 3) for role, u in usage.items()},
        "threads": {role: [{**t, "cpu_pct": significant(t["cpu_pct"], 3)} for t in u["threads"]]
                    for role, u in usage.items()},
        **gateway_workers(usage.get("gateway"), summary["completion_tokens_by_worker"]),
        "first_errors": summary["first_errors"],
    }


def gateway_workers(usage: dict | None, tokens_by_worker: dict[str, int]) -> dict:
    """With --workers N the gateway role is the parent, then its N workers: each worker's CPU%
    and the output tokens it served (x-gateway-worker), and for each the busiest over the least
    busy (issue 19's target: within 1.3x; None where one had none). None with one process."""
    workers = [process["cpu_pct"] for process in (usage or {}).get("processes", [])[1:]]
    if len(workers) < 2:
        return {"gateway_worker_cpu_pct": None, "gateway_worker_spread": None,
                "gateway_worker_tokens": None, "gateway_worker_token_spread": None}
    tokens = [tokens_by_worker.get(str(worker_id), 0) for worker_id in range(len(workers))]
    return {
        "gateway_worker_cpu_pct": [significant(pct, 3) for pct in workers],
        "gateway_worker_spread": _busiest_over_least(workers),
        "gateway_worker_tokens": tokens,
        "gateway_worker_token_spread": _busiest_over_least(tokens),
    }


def _busiest_over_least(loads: list[float]) -> float | None:
    return significant(max(loads) / min(loads), 3) if min(loads) > 0 else None


def ratio(value: float | None, baseline: float | None) -> float | None:
    return significant(value / baseline, 3) if value and baseline else None


class Report:
    """Collects rows as paths run; `finish` adds the ratios and writes everything."""

    def __init__(self, json_path: Path, *, settings: dict, engine_options: dict):
        self.json_path = json_path
        self.settings = {key: value if value is None or isinstance(value, (int, float, bool, list)) else str(value)
                         for key, value in settings.items()}
        self.engine_options = dict(engine_options)
        self.rows: list[dict] = []
        self.startup_s: dict[str, float] = {}
        self.errors: dict[str, str] = {}

    def cell_recorder(self, path: str, label: str):
        """on_cell("startup", None) once the path's engine or services are ready, then
        on_cell(streams, measurement, repeat) per cell; each prints a progress line."""
        started = time.monotonic()

        def on_cell(streams, cell: dict | None, repeat: int = 1) -> None:
            if cell is None:
                self.startup_s[path] = significant(time.monotonic() - started, 3)
                print(f"    ready in {self.startup_s[path]} s; warm-up", flush=True)
                return
            self.rows.append({"path": path, "label": label, "streams": streams, "repeat": repeat, **cell})
            print(f"    {streams:>4} streams (#{repeat}): {cell['output_tokens_per_s']} out tok/s, "
                  f"TTFT p50 {cell['ttft_p50_ms']} ms, ITL p50 {cell['itl_p50_ms']} ms, CPU% {cell['cpu_pct']}",
                  flush=True)
            num_failed = cell.get("num_requests", 0) - cell.get("num_succeeded", 0)
            if num_failed:  # a cell of refused requests must not read as a slow one
                print(f"    {num_failed} of {cell['num_requests']} requests failed {cell.get('errors_by_status')}, "
                      f"e.g. {(cell.get('first_errors') or ['?'])[0]}", file=sys.stderr, flush=True)
            self.write()

        return on_cell

    def failed(self, path: str, error: BaseException) -> None:
        self.errors[path] = f"{type(error).__name__}: {error}"
        print(f"    FAILED: {self.errors[path]}", file=sys.stderr, flush=True)
        self.write()

    def with_ratios(self) -> list[dict]:
        # A path's repeat k is compared with the core loop's repeat k (the same prompts).
        base = {(row["streams"], row["repeat"]): row for row in self.rows if row["path"] == BASELINE}
        rows = []
        for row in self.rows:
            core = base.get((row["streams"], row["repeat"]), {})
            gateway_cores = (row["cpu_pct"].get("gateway") or 0) / 100
            rows.append({
                **row,
                "output_ratio_vs_core": ratio(row["output_tokens_per_s"], core.get("output_tokens_per_s")),
                "itl_ratio_vs_core": ratio(row["itl_p50_ms"], core.get("itl_p50_ms")),
                "gateway_tokens_per_s_per_core": significant(row["output_tokens_per_s"] / gateway_cores)
                if gateway_cores and row["output_tokens_per_s"] else None,
            })
        return rows

    def write(self) -> None:
        rows = self.with_ratios()
        report = {"settings": self.settings, "engine_options": self.engine_options, "startup_s": self.startup_s,
                  "rows": rows, "spread": spreads(rows), "errors": self.errors}
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        self.json_path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")

    def finish(self, plot: bool) -> None:
        rows = self.with_ratios()
        print()
        print(format_table(rows))
        print()
        print(format_threads(rows))
        if any(row.get("engine_steps") for row in rows):
            print()
            print(engine_steps.format_steps(rows))
        print()
        print(format_first_tokens(rows))
        if any(row.get("first_token_hops_ms") for row in rows):
            print()
            print(format_hops(rows))
        if any(row["repeat"] > 1 for row in rows):
            print()
            print(format_spreads(spreads(rows)))
        for path, error in self.errors.items():
            print(f"{path}: FAILED: {error}")
        self.write()
        written = [self.json_path]
        if plot and rows:
            written.append(write_plot(self.json_path.with_suffix(".png"), rows))
        print("wrote " + ", ".join(map(str, written)))


# The row fields whose min/median/max over repeats the spread table gives.
SPREAD_FIELDS = ("output_tokens_per_s", "output_ratio_vs_core", "ttft_p50_ms", "itl_p50_ms", "itl_ratio_vs_core",
                 "gateway_tokens_per_s_per_core", "gateway_worker_spread", "gateway_worker_token_spread")
SPREAD_CPU_ROLES = ("engine-core", "gateway")


def spreads(rows: list[dict]) -> list[dict]:
    """Per (path, streams): min/median/max over its repeats of SPREAD_FIELDS and of the CPU% of
    SPREAD_CPU_ROLES (a field missing from a row, e.g. no gateway on the core path, is left out)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["path"], row["streams"]), []).append(row)
    result = []
    for (path, streams), group in groups.items():
        values = {name: [row[name] for row in group] for name in SPREAD_FIELDS}
        values.update({f"cpu_pct_{role}": [row["cpu_pct"].get(role) for row in group] for role in SPREAD_CPU_ROLES})
        entry = {"path": path, "label": group[0]["label"], "streams": streams, "num_repeats": len(group)}
        for name, found in values.items():
            present = sorted(v for v in found if v is not None)
            if present:
                entry[name] = {"min": present[0], "median": significant(statistics.median(present)), "max": present[-1]}
        result.append(entry)
    return result


def format_spreads(entries: list[dict]) -> str:
    names = [*SPREAD_FIELDS, *(f"cpu_pct_{role}" for role in SPREAD_CPU_ROLES)]
    header = ["path", "streams", "repeats", *(f"{name} min/med/max" for name in names)]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for entry in entries:
        cells = [entry["label"], entry["streams"], entry["num_repeats"]]
        cells += ["/".join(_cell(entry[name][key]) for key in ("min", "median", "max")) if name in entry else "-"
                  for name in names]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def _cell(value) -> str:
    return "-" if value is None else f"{value:,}" if isinstance(value, (int, float)) else str(value)


def format_table(rows: list[dict]) -> str:
    header = ["path", "streams", "out tok/s", "vs core", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL vs core",
              "tokens per message", *(f"CPU% {role}" for role in ROLES), "gateway tok/s per core",
              "gateway workers CPU% (max / min)", "gateway workers' tokens (max / min)"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        cells = [row["label"], row["streams"], row["output_tokens_per_s"], row["output_ratio_vs_core"],
                 row["ttft_p50_ms"], row["ttft_p99_ms"], row["itl_p50_ms"], row["itl_ratio_vs_core"],
                 row["tokens_per_message"], *(row["cpu_pct"].get(role) for role in ROLES), row["gateway_tokens_per_s_per_core"],
                 _workers_cell(row, "gateway_worker_cpu_pct", "gateway_worker_spread"),
                 _workers_cell(row, "gateway_worker_tokens", "gateway_worker_token_spread")]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def _workers_cell(row: dict, loads: str, spread: str) -> str:
    if not row.get(loads):
        return "-"
    return " / ".join(f"{load:g}" for load in row[loads]) + f" ({_cell(row[spread])})"


def format_threads(rows: list[dict]) -> str:
    """The busiest threads of each process, per row (`main`: a service's first thread, its event loop)."""
    lines = ["busiest threads (CPU%):"]
    for row in rows:
        parts = [f"{role}: " + ", ".join(f"{t['name']} {t['cpu_pct']}" for t in threads)
                 for role, threads in row["threads"].items() if threads]
        lines.append(f"  {row['label']} @ {row['streams']}: " + "; ".join(parts))
    return "\n".join(lines)


def format_first_tokens(rows: list[dict]) -> str:
    """Every row's first token, ms: the engine's own queue (mean / p99) beside the TTFT the
    client saw (mean / p99), the same measures on every path."""
    lines = ["first token, ms: engine queue mean / p99, client TTFT mean / p99:"]
    for row in rows:
        cells = " / ".join(_cell(row.get(key)) for key in ("queue_mean_ms", "queue_p99_ms"))
        ttft = " / ".join(_cell(row.get(key)) for key in ("ttft_mean_ms", "ttft_p99_ms"))
        lines.append(f"  {row['label']} @ {row['streams']} (#{row['repeat']}): queue {cells}, TTFT {ttft}")
    return "\n".join(lines)


def format_hops(rows: list[dict]) -> str:
    """The first token's mean ms per hop, per stack row (stack_hops.py)."""
    lines = ["first token, mean ms: gateway's preprocess hop / replica queue / gateway's TTFT / client's TTFT:"]
    for row in rows:
        hops = row.get("first_token_hops_ms")
        if hops:
            cells = " / ".join(_cell(hops[hop]) for hop in ("preprocess", "queue", "first_token", "client"))
            lines.append(f"  {row['label']} @ {row['streams']} (#{row['repeat']}): {cells}")
    return "\n".join(lines)


def write_plot(path: Path, rows: list[dict]) -> Path:
    """Output tok/s and ITL p50 against streams, one line per path."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    from matplotlib import pyplot as plt

    figure, (throughput, itl) = plt.subplots(1, 2, figsize=(11, 4))
    for label in dict.fromkeys(row["label"] for row in rows):
        mine = [row for row in rows if row["label"] == label]
        streams = [row["streams"] for row in mine]
        throughput.plot(streams, [row["output_tokens_per_s"] for row in mine], marker="o", label=label)
        itl.plot(streams, [row["itl_p50_ms"] for row in mine], marker="o", label=label)
    for axes, title in ((throughput, "output tok/s"), (itl, "ITL p50 (ms)")):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("concurrent streams")
        axes.set_title(title)
        axes.grid(True, alpha=0.3)
    throughput.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
