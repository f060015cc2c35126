"""Assembling a running gateway from its config: clients, tokenizer, router, servicer, server.

`start_gateway` is what __main__ runs and what in-process tests call. Start-up order: wait
(bounded) for a preprocess server (preprocess_servers: the others join as they serve), open
the prefix index (in memory, or Redis), bring up the inference replicas discovery finds
(replica_set: each must serve, with preprocess's block layout, or BlockLayoutMismatch refuses
to start), keep the first replica's model card, bind with a receive-message limit sized from
preprocess's prompt byte cap, then report SERVING ourselves.
Writing the port file is left to the caller (__main__), since it is the last step of start-up.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmserve.gateway.config import GatewayConfig
from llmserve.gateway.connection_age import connection_age_options
from llmserve.gateway.detokenizer import Detokenizer
from llmserve.gateway.generation import GenerationPipeline
from llmserve.gateway.inference_client import ModelCard
from llmserve.gateway.local_preprocess import LocalPreprocess
from llmserve.gateway.metrics import bind_worker
from llmserve.gateway.preprocess_servers import PreprocessServers
from llmserve.gateway.replica_set import ReplicaSet
from llmserve.gateway.router import Router
from llmserve.gateway.routing_index import RoutingIndex
from llmserve.gateway.servicer import SERVICE_NAME, GatewayServicer
from llmserve.gateway.worker_ports import own_address
from llmserve.message_limits import prompt_request_bytes
from llmserve.preprocessing.tokenizer import ModelTokenizer
from llmserve.server import RunningServer, create_server
from llmserve.v1 import gateway_pb2_grpc

if TYPE_CHECKING:  # imported where --http-port asks for it: aiohttp is needed only then
    from llmserve.gateway.openai_http import HttpServer

log = logging.getLogger(__name__)


@dataclass
class RunningGateway:
    server: RunningServer
    preprocess: PreprocessServers
    replicas: ReplicaSet
    index: RoutingIndex
    model: ModelCard
    http: "HttpServer | None" = None  # --http-port

    @property
    def port(self) -> int:
        return self.server.port

    async def close_clients(self) -> None:
        if self.http is not None:
            await self.http.close()
        await self.replicas.close()
        await self.index.close()
        await self.preprocess.close()


async def start_gateway(config: GatewayConfig, worker_id: int = 0) -> RunningGateway:
    """Connect to the hops, wait until they serve, and start the gateway (SERVING on return).

    `worker_id` names this process among the gateway's workers (gateway.worker_group); each worker
    binds `config.port` itself (grpc sets SO_REUSEPORT, so they share it), and with
    `config.worker_base_port` a port of its own too (gateway.worker_ports).
    """
    bind_worker(worker_id)
    preprocess = PreprocessServers(config)
    index: RoutingIndex | None = None
    replicas: ReplicaSet | None = None
    try:
        # Loading the tokenizer overlaps with waiting for the hops. One copy serves both uses:
        # detokenizing the output, and preprocessing small prompts here (local_preprocess).
        tokenizer_task = asyncio.create_task(asyncio.to_thread(ModelTokenizer.load, config.model_path, config.local_preprocess.max_text_pieces))
        preprocess_card = await preprocess.start()
        index = RoutingIndex.open(config)
        replicas = ReplicaSet(config, preprocess_card.block_layout, index.events)
        model = await replicas.start()
        tokenizer = await tokenizer_task
        local_preprocess = await asyncio.to_thread(
            LocalPreprocess.load, config.model_path, tokenizer, preprocess_card, config.local_preprocess
        )
    except BaseException:
        for part in (replicas, index, preprocess):
            if part is not None:
                await part.close()
        raise
    detokenizer = Detokenizer(tokenizer.decoder)
    model_name = config.model_name or model.model_name
    router = Router(config.routing, replicas.live, index.lookups)
    servicer = GatewayServicer(
        GenerationPipeline(preprocess.pool, router, detokenizer, local_preprocess), model, model_name, worker_id=worker_id
    )
    # A client's request is preprocess's, plus sampling: the same bound, from the same cap.
    max_receive_bytes = prompt_request_bytes(preprocess_card.max_prompt_bytes, preprocess_card.max_context_tokens)
    server = await create_server(
        config.address,
        lambda s: gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, s),
        (SERVICE_NAME,),
        max_receive_bytes=max_receive_bytes,
        options=connection_age_options(config.max_connection_age_s),
        num_accept_loops=config.num_accept_loops,
        second_address=own_address(config.host, config.worker_base_port, worker_id),
    )
    http = None
    if config.http_port is not None:
        from llmserve.gateway.openai_http import start_http_server

        http = await start_http_server(
            servicer, detokenizer, config.host, config.http_port, max_body_bytes=max_receive_bytes,
            max_connection_age_s=config.max_connection_age_s,
        )
    await server.set_serving(True)
    log.info(
        "gateway serving %s (%s, backend %s) on %s:%d; preprocess %s, inference %s (%d live, routing %s, index %s); %s",
        model_name, model.architecture, model.backend, config.host, server.port,
        ", ".join(map(str, config.preprocess_targets)),
        ", ".join(map(str, config.inference_targets)), len(replicas.live()), config.routing.policy.value,
        "in Redis" if config.redis else "in memory", config.stream_interval.describe(),
    )
    if server.second_port is not None:
        log.info("gateway worker %d's own port: %d", worker_id, server.second_port)
    if http is not None:
        log.info("OpenAI-compatible HTTP API on http://%s:%d/v1", config.host, http.port)
    return RunningGateway(server=server, preprocess=preprocess, replicas=replicas, index=index, model=model, http=http)
