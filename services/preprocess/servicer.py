"""The Preprocess gRPC servicer: protobuf in and out, the PreprocessPipeline in between.

Protobuf stops here: requests become internal types (`Chat`, `PromptTokenIds`, str). The cheap
checks run on the event loop, so an oversized or malformed request is refused before it waits
for anything; tokenizing runs in micro-batches on tokenizer threads (the Rust tokenizer releases
the GIL there, so the event loop stays free), within the byte budget (llmserve.preprocess.
pipeline). Errors propagate as `ServiceError`s to the interceptor installed by `create_server`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc

from llmserve import token_id_bytes
from llmserve.bidi_stream import served
from llmserve.buckets import LengthBucket
from llmserve.errors import ServiceError
from llmserve.pb import model_info_to_pb, prompt_input_from_pb, region_ids_to_pb, scope_to_pb
from llmserve.preprocess import metrics
from llmserve.preprocess.pipeline import PreprocessPipeline
from llmserve.preprocess.preprocess_stream import PreprocessStream
from llmserve.prompt_ids_region import RingOnDemand, local_scope
from llmserve.block_hash import check_cache_salt
from llmserve.request_context import bind_request_id, check_request_id
from llmserve.v1 import common_pb2, preprocess_pb2, preprocess_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = preprocess_pb2.DESCRIPTOR.services_by_name["PreprocessService"].full_name


def _bucket_to_pb(bucket: LengthBucket) -> common_pb2.LengthBucket:
    return common_pb2.LengthBucket(index=bucket.index, max_prompt_tokens=bucket.max_prompt_tokens)


class PreprocessServicer(preprocess_pb2_grpc.PreprocessServiceServicer):
    def __init__(self, pipeline: PreprocessPipeline, prompt_ids_ring: RingOnDemand | None = None):
        self._pipeline = pipeline
        self._preprocessor = pipeline.preprocessor
        self._prompt_ids_ring = prompt_ids_ring if prompt_ids_ring is not None else RingOnDemand(0, 1.0)
        self._scope = local_scope() if self._prompt_ids_ring.is_enabled else None

    async def Preprocess(
        self, request: preprocess_pb2.PreprocessRequest, context: grpc.aio.ServicerContext
    ) -> preprocess_pb2.PreprocessResponse:
        return await self.preprocess(request)

    async def PreprocessStream(
        self, request_iterator: AsyncIterator[preprocess_pb2.PreprocessStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[preprocess_pb2.PreprocessStreamResponse]:
        stream = PreprocessStream(self.preprocess)
        async for answer in served(stream.read(request_iterator), stream.answers(), stream.close):
            yield answer

    async def preprocess(self, request: preprocess_pb2.PreprocessRequest) -> preprocess_pb2.PreprocessResponse:
        """One request, for either RPC: its response, or the ServiceError it is refused with."""
        start_ns = time.perf_counter_ns()
        if request.request_id:
            bind_request_id(request.request_id)
        max_tokens = request.max_tokens if request.HasField("max_tokens") else None
        prompt_input = prompt_input_from_pb(request, "prompt")
        try:
            check_request_id(request.request_id)
            check_cache_salt(request.cache_salt)
            result = await self._pipeline.preprocess(prompt_input, max_tokens, request.cache_salt)
        except ServiceError as exc:
            metrics.record_failed(exc.code)
            # The reason an operator needs, as the client got it: any client value in it is
            # quoted short (llmserve.client_text), and the line's kind is rate-limited.
            log.info("rejected: %s", exc.message)
            raise
        except Exception:
            metrics.record_failed(grpc.StatusCode.INTERNAL)  # what the error interceptor answers
            raise
        elapsed_ns = time.perf_counter_ns() - start_ns
        metrics.record_preprocessed(len(result.token_ids), result.bucket, elapsed_ns / 1e9)
        log.debug(
            "preprocessed: prompt_tokens=%d bucket=%d max_tokens=%d preprocess_us=%d",
            len(result.token_ids),
            result.bucket.index,
            result.max_tokens,
            elapsed_ns // 1000,
            extra={"prompt": prompt_input, "prompt_token_ids": result.token_ids},
        )
        response = preprocess_pb2.PreprocessResponse(
            block_hashes=result.block_hashes,
            block_size_tokens=self._preprocessor.info.block_size_tokens,
            block_hash_version=self._preprocessor.info.block_hash_version,
            max_tokens=result.max_tokens,
            preprocess_time_ns=elapsed_ns,
        )
        self._set_token_ids(response, request, result.token_ids)
        return response

    def _set_token_ids(self, response: preprocess_pb2.PreprocessResponse, request: preprocess_pb2.PreprocessRequest,
                       token_ids: list[int]) -> None:
        """The ids as the request asked: in the ring for a long prompt (when it has room), else
        as bytes or as a list."""
        if 0 < request.token_ids_in_region_from <= len(token_ids) and self._prompt_ids_ring.is_enabled:
            packed = token_id_bytes.pack(token_ids)
            ref = self._prompt_ids_ring.put(packed)
            if ref is not None:
                metrics.IDS_WRITTEN_TO_REGION.inc()
                response.token_ids_in_region.CopyFrom(region_ids_to_pb(ref))
                return
            metrics.IDS_INLINE_RING_FULL.inc()
            if request.token_ids_as_bytes:
                response.token_id_bytes = packed
                return
        if request.token_ids_as_bytes:
            response.token_id_bytes = token_id_bytes.pack(token_ids)
        else:
            response.token_ids.extend(token_ids)

    async def Tokenize(
        self, request: preprocess_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> preprocess_pb2.TokenizeResponse:
        add_special_tokens = request.add_special_tokens if request.HasField("add_special_tokens") else None
        text_or_chat = prompt_input_from_pb(request, "text")
        try:
            result = await self._pipeline.tokenize(text_or_chat, add_special_tokens)
        except ServiceError as exc:
            log.info("tokenize rejected: %s", exc.message)
            raise
        return preprocess_pb2.TokenizeResponse(
            token_ids=result.token_ids, tokens=result.tokens, rendered_prompt=result.rendered_prompt
        )

    async def Detokenize(
        self, request: preprocess_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> preprocess_pb2.DetokenizeResponse:
        skip_special_tokens = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        token_ids = list(request.token_ids)
        try:
            text = await self._pipeline.detokenize(token_ids, skip_special_tokens)
        except ServiceError as exc:
            log.info("detokenize rejected: %s", exc.message)
            raise
        return preprocess_pb2.DetokenizeResponse(text=text)

    async def GetPreprocessInfo(
        self, request: preprocess_pb2.GetPreprocessInfoRequest, context: grpc.aio.ServicerContext
    ) -> preprocess_pb2.GetPreprocessInfoResponse:
        info = self._preprocessor.info
        model = model_info_to_pb(info, info.block_hash_version, tokenizer_vocab_size=info.vocab_size)
        return preprocess_pb2.GetPreprocessInfoResponse(
            model=model,
            max_output_tokens=info.max_output_tokens,
            buckets=[_bucket_to_pb(b) for b in info.buckets],
            has_chat_template=info.has_chat_template,
            max_prompt_bytes=info.max_prompt_bytes,
            chat_template_fingerprint=info.chat_template_fingerprint,
            shared_memory=scope_to_pb(self._scope) if self._scope is not None else None,
        )
