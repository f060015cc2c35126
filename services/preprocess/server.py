"""Start the preprocess server: load the tokenizer, bind, report SERVING, write the port file.

Used by `__main__` and by tests (in-process, port 0). The tokenizer and template are loaded
before the port is bound, so no RPC ever meets a half-loaded service; loading takes well under
a second even for 150k-token vocabularies.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from llmserve.message_limits import prompt_request_bytes
from llmserve.preprocess import metrics
from llmserve.preprocess.config import PreprocessConfig
from llmserve.preprocess.pipeline import PreprocessPipeline
from llmserve.preprocessing.preprocessor import Preprocessor
from llmserve.preprocess.servicer import SERVICE_NAME, PreprocessServicer
from llmserve.prompt_ids_region import RingOnDemand
from llmserve.server import RunningServer, create_server, write_port_file
from llmserve.v1 import preprocess_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class PreprocessServer:
    """A serving preprocess server and the pipeline (tokenizer threads, prompt cache) behind it."""

    running: RunningServer
    pipeline: PreprocessPipeline
    prompt_ids_ring: RingOnDemand

    @property
    def port(self) -> int:
        return self.running.port

    async def close(self) -> None:
        """Stop the tokenizer threads and the Redis client, unlink the prompt ids ring (after the
        gRPC server has stopped)."""
        await self.pipeline.close()
        self.prompt_ids_ring.close()


async def start_server(config: PreprocessConfig) -> PreprocessServer:
    """Load, bind `config.address`, set health SERVING and only then write the port file."""
    preprocessor = await asyncio.to_thread(Preprocessor.load, config.model_path, config.preprocessor_settings)
    pipeline = PreprocessPipeline.build(preprocessor, config)
    prompt_ids_ring = RingOnDemand(config.prompt_ids_region_mib * 1024 * 1024, config.prompt_ids_lease_s)
    servicer = PreprocessServicer(pipeline, prompt_ids_ring)
    info = preprocessor.info
    metrics.expose_buckets(info.buckets)
    max_receive_bytes = prompt_request_bytes(info.max_prompt_bytes, info.max_context_tokens)
    running = await create_server(
        config.address,
        lambda server: preprocess_pb2_grpc.add_PreprocessServiceServicer_to_server(servicer, server),
        [SERVICE_NAME],
        max_receive_bytes=max_receive_bytes,
    )
    await running.set_serving(True)
    write_port_file(config.port_file, running.port)
    log.info(
        "serving %s on port %d: vocab %d, context %d tokens, max output %d tokens, max prompt %d bytes, "
        "max message %d bytes, block size %d, buckets %s, chat template %s, %d tokenizer threads holding at most "
        "%d prompt bytes, micro-batches of up to %d prompts, prefix reuse %s, redis %s",
        info.model_name,
        running.port,
        info.vocab_size,
        info.max_context_tokens,
        info.max_output_tokens,
        info.max_prompt_bytes,
        max_receive_bytes,
        info.block_size_tokens,
        ",".join(str(b.max_prompt_tokens) for b in info.buckets),
        "yes" if info.has_chat_template else "no",
        config.num_tokenizer_threads,
        config.max_in_flight_prompt_bytes,
        config.max_batch_prompts,
        f"on ({config.prompt_cache_bytes} bytes in process)" if pipeline.is_reusing_prefixes else "off",
        config.redis_url if config.redis_url and pipeline.is_reusing_prefixes else "none",
    )
    return PreprocessServer(running=running, pipeline=pipeline, prompt_ids_ring=prompt_ids_ring)
