"""The tensor-parallel ranks other than 0: each a process that builds its slice of the model and
its own KV pool, then runs every step rank 0 broadcasts, until rank 0 says stop.

    rank 0 (engine-core process)                  rank r > 0 (this module)
    schedule ─▶ StepBroadcast.send ──shm ring──▶  StepBroadcast.receive
    forward (its slice) ◀── all-reduce/gather ──▶ forward (its slice)
    sample, update, stream                        (its logits are dropped)

A rank holds no request state: the block manager and the scheduler are rank 0's, and a rank's
pool is addressed by rank 0's block tables. So a rank is only ever told what to compute, and a
rank that dies cannot be replaced: the server sees its process end (engine_process.py) and
fails the engine.

On CUDA rank r runs on cuda:B+r of the visible devices, B the index --device names (`cuda`: 0),
so `llmserve serve --replicas N` can give replica i the GPUs i*size .. i*size+size-1 (`rank_config`).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.models.decoder_config import DecoderConfig, check_splittable
from llmserve.model_files import ModelFiles
from llmserve.observability import ObservabilityConfig

log = logging.getLogger(__name__)


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The engine config rank `rank` builds with: its own GPU on CUDA (cuda:B+rank, B the index
    config.device names, 0 for "cuda"), else `config` unchanged."""
    if not config.device.startswith("cuda"):
        return config
    _, _, index = config.device.partition(":")
    return dataclasses.replace(config, device=f"cuda:{int(index or 0) + rank}")


def check_tensor_parallel(config: EngineConfig) -> None:
    """ValueError for a tensor-parallel configuration this engine cannot run (before any spawn)."""
    size = config.tensor_parallel_size
    if size == 1:
        return
    if config.backend != "torch":
        raise ValueError(f"tensor_parallel_size {size} needs the torch backend, not {config.backend!r}")
    if not config.core_process:
        raise ValueError(f"tensor_parallel_size {size} needs the engine core in its own process (no --no-core-process)")
    if config.kv_pull:
        raise ValueError(f"tensor_parallel_size {size} cannot be used with --kv-pull: a pull would copy rank 0's KV heads only")
    check_gpus_for_ranks(config.device, size)
    files = ModelFiles.load(config.model_path, config.model_name)
    check_splittable(DecoderConfig.from_hf(files.config), size)


def check_gpus_for_ranks(device: str, size: int, num_gpus: int | None = None) -> None:
    """Rank r runs on the device's index + r (rank_config): ValueError, naming what is missing,
    when those GPUs are not all visible here, before any rank is spawned to find out alone."""
    if not device.startswith("cuda"):
        return
    first = torch.device(device).index or 0
    num_gpus = torch.cuda.device_count() if num_gpus is None else num_gpus
    if first + size > num_gpus:
        raise ValueError(
            f"tensor_parallel_size {size} on {device} needs GPUs {first}..{first + size - 1}, and "
            f"{num_gpus} {'is' if num_gpus == 1 else 'are'} visible here (CUDA_VISIBLE_DEVICES, the pod's GPU count)"
        )


def run_rank_worker(
    config: EngineConfig, rank: int, store_path: str, log_level: str, observability: ObservabilityConfig
) -> None:
    """A rank process's main: join, build, run steps until rank 0 stops (or the group breaks)."""
    from llmserve.inference.engine.engine_process import exit_with_parent
    from llmserve.inference.models.rank_group import exit_without_teardown
    from llmserve.server import configure_logging

    exit_with_parent()
    configure_logging(f"engine-rank-{rank}", log_level, observability)
    config = rank_config(config, rank)
    runner, group = build_rank_runner(config, rank, store_path)
    num_steps = run_steps(runner, group)
    log.info("rank %d stopped after %d steps", rank, num_steps)
    group.leave()
    exit_without_teardown()


def build_rank_runner(config: EngineConfig, rank: int, store_path: str):
    """(this rank's ModelRunner, its RankGroup): joins the group, then builds in lockstep with
    the other ranks (the KV pool size and the CUDA-graph captures are collectives)."""
    import torch

    from llmserve.inference.engine.model_runner import ModelRunner
    from llmserve.inference.engine.types import served_context_tokens
    from llmserve.inference.models.rank_group import RankGroup

    group = RankGroup.join(store_path, config.tensor_parallel_size, rank, torch.device(config.device))
    files = ModelFiles.load(config.model_path, config.model_name)
    return ModelRunner(config, files, served_context_tokens(config, files), ranks=group), group


def run_steps(runner, group) -> int:
    """Run each step rank 0 broadcasts; the number run once it says stop."""
    from llmserve.inference.engine.step_broadcast import StepBroadcast

    steps = StepBroadcast(group, runner.device)
    num_steps = 0
    while (step := steps.receive()) is not None:
        runner.execute_step(step.block_copies, step.inputs, step.launched_tokens)
        num_steps += 1
    return num_steps
