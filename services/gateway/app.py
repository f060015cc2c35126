"""Assembling a running gateway from its config: clients, tokenizer, servicer, server.

`start_gateway` is what __main__ runs and what in-process tests call. Start-up order: wait
(bounded) for preprocess and every inference replica to report SERVING, read their block
layouts and refuse to start on a mismatch (BlockLayoutMismatch), keep the first replica's model
card, bind with a receive-message limit sized from preprocess's prompt byte cap, then report
SERVING ourselves. Writing the port file is left to the caller (__main__), since
it is the last step of start-up.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from llmserve.gateway.block_layout import check_block_layouts
from llmserve.gateway.config import GatewayConfig
from llmserve.gateway.detokenizer import Detokenizer
from llmserve.gateway.generation import GenerationPipeline
from llmserve.gateway.inference_client import InferenceClient, ModelCard
from llmserve.gateway.preprocess_client import PreprocessClient, PreprocessInfo
from llmserve.gateway.servicer import SERVICE_NAME, GatewayServicer
from llmserve.message_limits import prompt_request_bytes
from llmserve.server import RunningServer, create_server
from llmserve.v1 import gateway_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class RunningGateway:
    server: RunningServer
    preprocess: PreprocessClient
    inference: InferenceClient
    model: ModelCard

    @property
    def port(self) -> int:
        return self.server.port

    async def close_clients(self) -> None:
        await self.inference.close()
        await self.preprocess.close()


async def _read_model_cards(config: GatewayConfig, inference: InferenceClient) -> list[ModelCard]:
    """Every replica's model card once it serves (`inference` is the first replica's client)."""
    others = [InferenceClient(address) for address in config.inference_addresses[1:]]
    try:
        replicas = [inference, *others]
        await asyncio.gather(*(r.wait_until_serving(config.downstream_ready_timeout_s) for r in replicas))
        return list(await asyncio.gather(*(r.get_model_card() for r in replicas)))
    finally:
        await asyncio.gather(*(r.close() for r in others))


async def _check_hops(
    config: GatewayConfig, preprocess: PreprocessClient, inference: InferenceClient
) -> tuple[PreprocessInfo, ModelCard]:
    """Wait for the hops, check that their block layouts agree; preprocess's info and the first
    replica's card."""
    await preprocess.wait_until_serving(config.downstream_ready_timeout_s)
    preprocess_info, cards = await asyncio.gather(preprocess.get_info(), _read_model_cards(config, inference))
    replica_layouts = dict(zip(config.inference_addresses, (card.block_layout for card in cards)))
    check_block_layouts(preprocess_info.block_layout, replica_layouts)
    return preprocess_info, cards[0]


async def start_gateway(config: GatewayConfig, worker_id: int = 0) -> RunningGateway:
    """Connect to the hops, wait until they serve, and start the gateway (SERVING on return).

    `worker_id` names this process among the gateway's workers (gateway.worker_group); each worker
    binds `config.port` itself (grpc sets SO_REUSEPORT, so they share it).
    """
    if len(config.inference_addresses) > 1:
        log.warning("%d inference replicas given; only the first is used for now", len(config.inference_addresses))
    preprocess = PreprocessClient(config.preprocess_address)
    inference = InferenceClient(
        config.inference_addresses[0], multiplex=config.multiplex, abort_timeout_s=config.abort_timeout_s
    )
    try:
        # Loading the tokenizer overlaps with waiting for the hops.
        detokenizer_task = asyncio.create_task(asyncio.to_thread(Detokenizer.from_model_dir, config.model_path))
        preprocess_info, model = await _check_hops(config, preprocess, inference)
        detokenizer = await detokenizer_task
    except BaseException:
        await inference.close()
        await preprocess.close()
        raise
    model_name = config.model_name or model.model_name
    servicer = GatewayServicer(
        GenerationPipeline(preprocess, inference, detokenizer), model, model_name,
        worker_id=worker_id, max_unsent_tokens=config.max_unsent_tokens,
    )
    server = await create_server(
        config.address,
        lambda s: gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, s),
        (SERVICE_NAME,),
        # A client's request is preprocess's, plus sampling: the same bound, from the same cap.
        max_receive_bytes=prompt_request_bytes(preprocess_info.max_prompt_bytes, preprocess_info.max_context_tokens),
    )
    await server.set_serving(True)
    log.info(
        "gateway serving %s (%s, backend %s) on %s:%d; preprocess %s, inference %s",
        model_name, model.architecture, model.backend, config.host, server.port,
        config.preprocess_address, config.inference_addresses[0],
    )
    return RunningGateway(server=server, preprocess=preprocess, inference=inference, model=model)
