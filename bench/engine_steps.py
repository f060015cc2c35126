"""What the engine's steps did during a bench cell, described alike for every path (issue 19: at
256 streams the served stack's requests waited 0.5-1.6 s on average in the replica's queue, the
core loop's a fraction of that, and nothing said whether the replica ran fewer steps, emptier
ones or slower ones).

Per cell: the steps that ran a batch, their mean duration, the mean sequences in one, and the
share of the cell's wall time spent in steps. The served paths read the inference server's
/metrics before and after the cell (`llmserve_inference_step_duration_seconds` and
`llmserve_inference_batch_size`: one observation per step); the core loop counts its own steps
(`StepTally.add` after each `EngineCore.step()`). With async scheduling a step's duration is
about one step period either way: the call launches one batch and finishes the one before.
"""

from __future__ import annotations

from dataclasses import dataclass

from metrics_scrape import sample_totals

STEP_DURATION = "llmserve_inference_step_duration_seconds"
BATCH_SIZE = "llmserve_inference_batch_size"


@dataclass(slots=True)
class StepTally:
    """Running sums over steps that ran a batch."""

    num_steps: int = 0
    total_s: float = 0.0
    total_seqs: float = 0.0

    def add(self, duration_s: float, num_seqs: int) -> None:
        if num_seqs:
            self.num_steps += 1
            self.total_s += duration_s
            self.total_seqs += num_seqs

    def since(self, before: "StepTally") -> "StepTally":
        return StepTally(self.num_steps - before.num_steps, self.total_s - before.total_s,
                         self.total_seqs - before.total_seqs)

    def summary(self, wall_s: float) -> dict | None:
        """steps, step_ms (mean), seqs_per_step (mean), busy (step time over the wall time)."""
        if not self.num_steps:
            return None
        return {
            "steps": self.num_steps,
            "step_ms": round(1000 * self.total_s / self.num_steps, 3),
            "seqs_per_step": round(self.total_seqs / self.num_steps, 1),
            "busy": round(self.total_s / wall_s, 3) if wall_s > 0 else None,
        }


def scrape_steps(metrics_port: int) -> StepTally:
    """The inference server's step sums so far (its histograms' _count and _sum)."""
    values = sample_totals(metrics_port)
    return StepTally(int(values.get(STEP_DURATION + "_count", 0)), values.get(STEP_DURATION + "_sum", 0.0),
                     values.get(BATCH_SIZE + "_sum", 0.0))


def format_steps(rows: list[dict]) -> str:
    """One line per row that has them: steps, mean ms, mean sequences, busy."""
    lines = ["engine steps per cell: steps / mean step ms / mean sequences per step / share of the cell in steps:"]
    for row in rows:
        steps = row.get("engine_steps")
        if steps:
            busy = "-" if steps["busy"] is None else f"{steps['busy']:.0%}"
            lines.append(f"  {row['label']} @ {row['streams']} (#{row['repeat']}): {steps['steps']} / "
                         f"{steps['step_ms']} / {steps['seqs_per_step']} / {busy}")
    return "\n".join(lines)
