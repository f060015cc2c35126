"""Assembling a running gateway from its config: clients, tokenizer, servicer, server.

`start_gateway` is what __main__ runs and what in-process tests call. Start-up order: wait
(bounded) for preprocess and inference to report SERVING, read the model card once, bind,
then report SERVING ourselves. Writing the port file is left to the caller (__main__), since
it is the last step of start-up.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from llmserve.gateway.clients import InferenceClient, ModelCard, PreprocessClient
from llmserve.gateway.config import GatewayConfig
from llmserve.gateway.detokenizer import Detokenizer
from llmserve.gateway.generation import GenerationPipeline
from llmserve.gateway.servicer import SERVICE_NAME, GatewayServicer
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

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop serving (draining for `grace_s`) and close the downstream channels."""
        await self.server.set_serving(False)
        await self.server.server.stop(grace_s)
        await self.close_clients()

    async def close_clients(self) -> None:
        await self.inference.close()
        await self.preprocess.close()


async def start_gateway(config: GatewayConfig) -> RunningGateway:
    """Connect to the hops, wait until they serve, and start the gateway (SERVING on return)."""
    if len(config.inference_addresses) > 1:
        log.warning("%d inference replicas given; only the first is used for now", len(config.inference_addresses))
    preprocess = PreprocessClient(config.preprocess_address)
    inference = InferenceClient(config.inference_addresses[0], abort_timeout_s=config.abort_timeout_s)
    try:
        # Loading the tokenizer overlaps with waiting for the hops.
        detokenizer_task = asyncio.create_task(asyncio.to_thread(Detokenizer.from_model_dir, config.model_path))
        await asyncio.gather(
            preprocess.wait_until_serving(config.downstream_ready_timeout_s),
            inference.wait_until_serving(config.downstream_ready_timeout_s),
        )
        model = await inference.get_model_card()
        detokenizer = await detokenizer_task
    except BaseException:
        await inference.close()
        await preprocess.close()
        raise
    model_name = config.model_name or model.model_name
    servicer = GatewayServicer(GenerationPipeline(preprocess, inference, detokenizer), model, model_name)
    server = await create_server(
        config.address,
        lambda s: gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, s),
        (SERVICE_NAME,),
    )
    await server.set_serving(True)
    log.info(
        "gateway serving %s (%s, backend %s) on %s:%d; preprocess %s, inference %s",
        model_name, model.architecture, model.backend, config.host, server.port,
        config.preprocess_address, config.inference_addresses[0],
    )
    return RunningGateway(server=server, preprocess=preprocess, inference=inference, model=model)
