"""The inference server's work per engine step at N streams (issue 19): the engine-core
process's message unpacked, AsyncEngine's delivery (admission, metrics, each request's
OutputStream), and each Multiplex call's response built and serialized, with plain tokens as
RequestOutputs (what a client that does not ask for columns gets) and as TokenColumns (what our
gateway asks for), interleaved in one run; and the gateway's side of the same messages (its
workers together): parsed, each output pushed into its request's buffer
(replica_stream.MultiplexedTokens), and each buffer taken as its handler takes it.

    python bench/bench_server_fanout.py                 # 256 streams on 4 Multiplex calls
    python bench/bench_server_fanout.py --streams 64 --calls 1

No engine runs: a stand-in core client hands AsyncEngine one message per step of --streams
plain tokens, pickled as engine_process sends it, so only the server process's own code is
timed (the event loop is not entered; the responses are built as MultiplexedStream builds them).
The first step of each form and repeat checks that its messages carry every stream's token once,
in that form. Prints median µs per step per part for each form, min / median / max over --repeat, and the
columns' ratio to the objects'; writes JSON to --out-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import statistics
import tempfile
import time
from pathlib import Path

from llmserve.engine_output import StepOutputs, TokenColumns
from llmserve.gateway.replica_stream import MultiplexedTokens, push_token_columns
from llmserve.gateway.slow_reader import SlowReaderBounds
from llmserve.inference.async_engine import AsyncEngine
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.engine.cores import create_engine_core
from llmserve.inference.engine.engine_loop import CoreUpdate
from llmserve.inference.engine.engine_process import from_wire, to_wire
from llmserve.inference.engine.types import EngineLoad, EngineRequest
from llmserve.inference.multiplex import _response
from llmserve.inference.output_stream import OutputStream
from llmserve.sampling import SamplingParams
from llmserve.tools.tiny_model import build_tiny_model
from llmserve.v1 import inference_pb2

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVER_PARTS = ("unpack", "deliver", "respond")  # the inference server process's
PARTS = (*SERVER_PARTS, "gateway_read")  # the gateway's workers, together


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256, help="(default: %(default)s)")
    parser.add_argument("--calls", type=int, default=4, help="Multiplex calls the streams are spread over (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200, help="steps timed per form and repeat (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="(default: %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results")
    return parser.parse_args()


class StandInCore:
    """A core client that runs nothing: the bench calls its `deliver` with each step's update."""

    def __init__(self, model_info, num_blocks: int):
        self.model_info = model_info
        self._num_blocks = num_blocks
        self.deliver = None

    def start(self, loop, deliver) -> None:
        self.deliver = deliver

    @property
    def is_running(self) -> bool:
        return True

    def add_request(self, request) -> None:
        pass

    def abort_request(self, request_id) -> None:
        pass

    def load(self) -> EngineLoad:
        return EngineLoad(num_running=0, num_waiting=0, kv_blocks_total=self._num_blocks, kv_blocks_used=0)


async def measure(args) -> dict:
    num_blocks = args.streams * 64
    model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="fanout-")), "llama")
    core = create_engine_core(EngineConfig(
        model_path=model_dir, model_name="bench", num_kv_blocks=16, max_context_tokens=1024, max_num_seqs=args.streams,
    ))  # fmt: skip  # only its ModelInfo is used
    client = StandInCore(core.model_info, num_blocks)
    engine = AsyncEngine(client)
    await engine.start()
    streams = [OutputStream(engine) for _ in range(args.calls)]
    request_ids = [f"{i:032x}" for i in range(args.streams)]
    # Admission reserves blocks by max_tokens; the stand-in never ends a request, so any will do.
    max_tokens = 64
    for i, request_id in enumerate(request_ids):
        request = EngineRequest(request_id, list(range(8)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                time.monotonic_ns())
        streams[i % args.calls].start(request)
    buffers = {request_id: MultiplexedTokens(request_id, lambda request_id, abort: None, SlowReaderBounds(max_unsent_tokens=0, max_unread_s=0))
               for request_id in request_ids}
    runs = {form: [] for form in ("objects", "columns")}
    for _ in range(args.repeat):
        for form in runs:
            times = {part: [] for part in PARTS}
            for step in range(args.steps):
                outputs = StepOutputs([], TokenColumns(list(request_ids), [0] * args.streams, [step % 1000 + 5] * args.streams))
                message = pickle.dumps((to_wire(outputs), None, [], None))
                start = time.perf_counter()
                wire, _, _, _ = pickle.loads(message)
                update = CoreUpdate(from_wire(wire), [], [])
                unpacked = time.perf_counter()
                client.deliver(update)
                delivered = time.perf_counter()
                messages = [
                    _response(*stream.take(), token_columns=form == "columns").SerializeToString() for stream in streams
                ]
                responded = time.perf_counter()
                if step == 0:
                    check_messages(messages, args.streams, form)
                read_start = time.perf_counter()
                gateway_read(messages, buffers)
                times["gateway_read"].append(time.perf_counter() - read_start)
                times["unpack"].append(unpacked - start)
                times["deliver"].append(delivered - unpacked)
                times["respond"].append(responded - delivered)
            runs[form].append({part: statistics.median(values) * 1e6 for part, values in times.items()})
    return {"streams": args.streams, "calls": args.calls, "steps": args.steps, "messages_checked": True, "runs": runs}


def gateway_read(messages: list[bytes], buffers: dict[str, MultiplexedTokens]) -> None:
    """What a gateway's reader task and its requests' handlers do with the step's messages."""
    for message in messages:
        response = inference_pb2.MultiplexResponse.FromString(message)
        for output in response.outputs:
            buffers[output.request_id].push(output)
        if response.tokens.request_ids:
            push_token_columns(buffers, response.tokens)
    for tokens in buffers.values():
        tokens._take()  # what its handler's next read takes (the async iteration around it aside)


def check_messages(messages: list[bytes], num_streams: int, form: str) -> None:
    """Every stream's token is in the step's messages, once, in the form asked for."""
    responses = [inference_pb2.MultiplexResponse.FromString(message) for message in messages]
    in_columns = sum(len(response.tokens.token_ids) for response in responses)
    in_outputs = sum(len(output.output.token_ids) for response in responses for output in response.outputs)
    expected = (num_streams, 0) if form == "columns" else (0, num_streams)
    assert (in_columns, in_outputs) == expected, (form, in_columns, in_outputs)


def print_table(report: dict) -> None:
    runs = report["runs"]
    print(f"{report['streams']} streams on {report['calls']} Multiplex calls, µs per step, min / median / max of "
          f"{len(runs['objects'])} repeats")
    print("| part | RequestOutputs | TokenColumns | columns / objects (medians) |")
    print("| --- | --- | --- | --- |")
    for part in (*SERVER_PARTS, "inference server total", "gateway_read"):
        cells = []
        for form in ("objects", "columns"):
            if part == "inference server total":
                values = sorted(sum(run[p] for p in SERVER_PARTS) for run in runs[form])
            else:
                values = sorted(run[part] for run in runs[form])
            cells.append(values)
        ratio = statistics.median(cells[1]) / statistics.median(cells[0])
        text = [" / ".join(f"{v:,.0f}" for v in (values[0], statistics.median(values), values[-1])) for values in cells]
        print(f"| {part} | {text[0]} | {text[1]} | {ratio:.2f}x |")


def main() -> None:
    args = parse_args()
    report = asyncio.run(measure(args))
    print_table(report)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"server-fanout-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
