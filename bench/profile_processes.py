"""Profile a running benchmark's processes with py-spy, all at once, and summarize each profile.

    python bench/bench_stack.py --streams 256 --paths gateway > stack.log &
    python bench/profile_processes.py --after-line "ready in" --log stack.log --delay-s 8 \
        --role gateway=llmserve.gateway --role inference=llmserve.inference --native inference-child

Waits until --log has a line containing --after-line (a bench's progress line), then --delay-s
more (the warm-up), then records every process whose command line contains a --role pattern,
and each child of one (a gateway's workers, the inference server's engine-core process, named
`<role>-child`), for --duration-s at --rate Hz, concurrently. Roles named by --native are
recorded with native frames (py-spy's default blocking mode: the process is paused at each
sample, so its own speed drops while it is recorded).

Writes, per process, py-spy's raw collapsed stacks (`<role>-<pid>.txt`: one stack per line with
its sample count, for flamegraph tools or speedscope) and prints, per process, the functions
holding the most samples: inclusive (on the stack) and self (the leaf), as % of its samples.
Needs py-spy (a wheel: `pip install py-spy`) and the right to ptrace the processes (root, or
the same user with ptrace allowed).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import time
from pathlib import Path

TOP_FUNCTIONS = 25
FRAME_LINE = re.compile(r":\d+\)$")  # "func (file.py:123)" → "func (file.py)": one entry per function


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", action="append", required=True, metavar="NAME=PATTERN",
                        help="processes whose command line contains PATTERN are NAME (repeatable)")
    parser.add_argument("--native", action="append", default=[], metavar="ROLE",
                        help="record this role with native frames (repeatable; e.g. inference-child)")
    parser.add_argument("--log", type=Path, help="the file to watch for --after-line")
    parser.add_argument("--after-line", help="start once --log has a line containing this")
    parser.add_argument("--delay-s", type=float, default=0.0, help="then wait this long (default: %(default)s)")
    parser.add_argument("--wait-timeout-s", type=float, default=600.0, help="(default: %(default)s)")
    parser.add_argument("--duration-s", type=float, default=10.0, help="(default: %(default)s)")
    parser.add_argument("--rate", type=int, default=100, help="samples per second (default: %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=Path("bench/results/profiles"))
    parser.add_argument("--py-spy", default="py-spy", help="the py-spy executable (default: %(default)s)")
    args = parser.parse_args(argv)
    args.role = [tuple(value.split("=", 1)) for value in args.role]
    if any(len(pair) != 2 for pair in args.role):
        parser.error("--role takes NAME=PATTERN")
    if bool(args.log) != bool(args.after_line):
        parser.error("--log and --after-line go together")
    return args


def wait_for_line(path: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and any(text in line for line in path.read_text(errors="replace").splitlines()):
            return
        time.sleep(0.2)
    raise SystemExit(f"no line with {text!r} in {path} within {timeout_s:g} s")


def find_processes(roles: list[tuple[str, str]]) -> dict[int, str]:
    """pid → role: processes matching a role's pattern, and their children not matched themselves."""
    table = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True).stdout
    rows = [line.split(None, 2) for line in table.splitlines()]
    rows = [(int(pid), int(ppid), args[0] if args else "") for pid, ppid, *args in rows]
    found = {}
    for pid, _, command in rows:
        for name, pattern in roles:
            if pattern in command and "profile_processes" not in command:
                found[pid] = name
                break
    for pid, ppid, _ in rows:
        if ppid in found and pid not in found and not found[ppid].endswith("-child"):
            found[pid] = f"{found[ppid]}-child"
    return found


def record(args, processes: dict[int, str]) -> dict[int, Path]:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    running, outputs = [], {}
    for pid, role in sorted(processes.items()):
        outputs[pid] = args.out_dir / f"{role}-{pid}.txt"
        command = [args.py_spy, "record", "--pid", str(pid), "--duration", str(int(args.duration_s)),
                   "--rate", str(args.rate), "--format", "raw", "--output", str(outputs[pid])]
        if role in args.native:
            command.append("--native")
        running.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    for pid, process in zip(sorted(processes), running):
        _, stderr = process.communicate()
        if process.returncode != 0:
            print(f"py-spy on {processes[pid]} {pid} failed: {stderr.strip()[-300:]}", file=sys.stderr)
            outputs.pop(pid)
    return outputs


def summarize(path: Path) -> tuple[int, list[tuple[str, float]], list[tuple[str, float]]]:
    """(samples, top inclusive, top self) of one raw profile, as % of its samples."""
    inclusive, leaf, total = collections.Counter(), collections.Counter(), 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = [FRAME_LINE.sub(")", frame) for frame in stack.split(";")]
        total += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
        leaf[frames[-1]] += int(count)

    def top(counter):
        return [(frame, 100.0 * n / total) for frame, n in counter.most_common(TOP_FUNCTIONS)]

    return total, top(inclusive), top(leaf)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.log:
        wait_for_line(args.log, args.after_line, args.wait_timeout_s)
    time.sleep(args.delay_s)
    processes = find_processes(args.role)
    if not processes:
        raise SystemExit(f"no process matches {args.role}")
    print(f"recording {len(processes)} processes for {args.duration_s:g} s: "
          + ", ".join(f"{role} {pid}" for pid, role in sorted(processes.items())), flush=True)
    for pid, path in record(args, processes).items():
        total, inclusive, own = summarize(path)
        print(f"\n## {processes[pid]} {pid}: {total} samples ({path})")
        print("inclusive %   self %  function")
        self_share = dict(own)
        for frame, share in inclusive:
            print(f"{share:10.1f} {self_share.get(frame, 0.0):8.1f}  {frame}")
        print("top self: " + "; ".join(f"{frame} {share:.1f}%" for frame, share in own[:8]))


if __name__ == "__main__":
    main()
