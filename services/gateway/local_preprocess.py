"""Small prompts preprocessed in the gateway's own process at light load: no preprocess hop.

Why: the preprocess call is a round trip on the first token's path, before anything reaches the
engine. At one stream it is most of what the gateway adds to the first token (docs/benchmarks.md,
issue 19), and the work it carries is small: 512 tokens of text tokenize in ~0.6 ms. TGI's
router, vLLM's API server and SGLang's tokenizer manager all tokenize in the process that takes
the request; here the preprocess tier keeps what is worth a hop: long prompts, and every prompt
once the gateway is busy.

A request is preprocessed here when both hold:
  - its prompt is at most `max_prompt_bytes` (UTF-8 bytes of the text or of a chat's roles and
    contents; 5 bytes per token id, as the tier counts them), and
  - this worker has at most `max_in_flight` requests in flight, the new one included: the work
    runs on the event loop, which at light load keeps nobody waiting, and which is the gateway's
    scarcest resource under load.
The answer is the tier's: the same steps (`Preprocessor.preprocess`: check, render, tokenize,
resolve max_tokens, hash blocks) with the tier's limits and block size, taken from its card. It
is turned on only where the gateway's checkpoint is the tier's (its block layout, with the
fingerprints of config.json and tokenizer.json, agrees, and so does the chat template's
fingerprint); otherwise a log line says why and every request goes to the tier. Chats are rendered and tokenized whole: the
tier's prompt cache, which splices a cached system prompt's ids, stays the tier's.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from llmserve import token_id_bytes
from llmserve.client_text import num_bytes
from llmserve.config_checks import check_at_least
from llmserve.errors import InvalidArgument
from llmserve.gateway.block_layout import BlockLayout
from llmserve.gateway.preprocess_client import PREPROCESS_FIELDS_AS_CLIENT_FIELDS, PreparedPrompt, PreprocessCard
from llmserve.message_limits import MAX_TOKEN_ID_BYTES
from llmserve.preprocessing import validation
from llmserve.preprocessing.preprocessor import Preprocessor, PreprocessorSettings
from llmserve.preprocessing.text_pieces import DEFAULT_MAX_TEXT_PIECES, add_text_pieces_argument
from llmserve.preprocessing.tokenizer import ModelTokenizer
from llmserve.prompt_input import PromptInput, PromptTokenIds

log = logging.getLogger(__name__)

# 8 KiB of text is ~2,000 tokens: ~2 ms of the event loop at most.
DEFAULT_MAX_PROMPT_BYTES = 8 * 1024
DEFAULT_MAX_IN_FLIGHT = 4


@dataclass(frozen=True, slots=True)
class LocalPreprocessConfig:
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES  # 0: every request goes to the tier
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT  # this worker's requests, the new one included
    max_text_pieces: int = DEFAULT_MAX_TEXT_PIECES  # a prompt text tokenized in up to this many pieces at once

    def __post_init__(self) -> None:
        check_at_least("max_prompt_bytes", self.max_prompt_bytes, 0, " (0: off)")
        check_at_least("max_in_flight", self.max_in_flight, 1)
        check_at_least("max_text_pieces", self.max_text_pieces, 1)

    @property
    def is_on(self) -> bool:
        return self.max_prompt_bytes > 0


def add_local_preprocess_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--local-preprocess-max-bytes", type=int, default=DEFAULT_MAX_PROMPT_BYTES, metavar="BYTES",
        help="preprocess a prompt of at most this many UTF-8 bytes (5 per token id) in the gateway itself "
        "while the worker is lightly loaded (--local-preprocess-max-in-flight), sparing the first token the "
        "preprocess round trip; larger prompts, and all under load, go to --preprocess; 0: all go there "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--local-preprocess-max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT, metavar="N",
        help="lightly loaded: at most this many requests in flight in the worker, the new one included "
        "(default: %(default)s)",
    )
    add_text_pieces_argument(parser)


def local_preprocess_config(args: argparse.Namespace) -> LocalPreprocessConfig:
    return LocalPreprocessConfig(args.local_preprocess_max_bytes, args.local_preprocess_max_in_flight, args.max_text_pieces)


class LocalPreprocess:
    """The gateway's own preprocessor and the rule for when it answers. Build with `load`."""

    def __init__(self, preprocessor: Preprocessor, config: LocalPreprocessConfig):
        self._preprocessor = preprocessor
        self._config = config

    @classmethod
    def load(
        cls, model_path: Path, tokenizer: ModelTokenizer, card: PreprocessCard, config: LocalPreprocessConfig
    ) -> "LocalPreprocess | None":
        """The preprocessor for `model_path` (whose `tokenizer` the gateway loaded already) with
        the tier's limits, or None (off, or a checkpoint that is not the tier's: logged).
        Blocking: reads the checkpoint's config and compiles its chat template."""
        if not config.is_on:
            return None
        settings = PreprocessorSettings(
            max_output_tokens=card.max_output_tokens, block_size_tokens=card.block_layout.block_size_tokens,
            reuse_prefixes=False, max_context_tokens=card.max_context_tokens, max_prompt_bytes=card.max_prompt_bytes,
        )
        try:
            preprocessor = Preprocessor.load(model_path, settings, tokenizer)
        except (OSError, ValueError) as error:
            log.warning("small prompts go to preprocess too: the gateway cannot preprocess them itself (%s)", error)
            return None
        differences = _differences(preprocessor, card)
        if differences:
            log.warning(
                "small prompts go to preprocess too: the gateway's checkpoint %s is not preprocess's (%s)",
                model_path, ", ".join(differences),
            )
            return None
        log.info(
            "prompts of up to %d bytes are preprocessed in the gateway while it has at most %d requests in flight",
            config.max_prompt_bytes, config.max_in_flight,
        )
        return cls(preprocessor, config)

    def takes(self, prompt_input: PromptInput | None, num_in_flight: int) -> bool:
        """Whether this request is preprocessed here (`num_in_flight` counts it)."""
        return (
            num_in_flight <= self._config.max_in_flight
            and prompt_input is not None
            and _prompt_bytes(prompt_input) <= self._config.max_prompt_bytes
        )

    def preprocess(self, prompt_input: PromptInput, *, max_tokens: int | None, cache_salt: str) -> PreparedPrompt:
        """What preprocess would answer, or the InvalidArgument it would refuse with, naming the
        client's field as the tier's answers are relabelled (PREPROCESS_FIELDS_AS_CLIENT_FIELDS)."""
        start_ns = time.perf_counter_ns()
        try:
            result = self._preprocessor.preprocess(prompt_input, max_tokens, cache_salt)
        except InvalidArgument as error:
            field = PREPROCESS_FIELDS_AS_CLIENT_FIELDS.get(error.field, error.field)
            raise InvalidArgument(field, error.problem) from None
        return PreparedPrompt(
            token_id_bytes=token_id_bytes.pack(result.token_ids),
            block_hashes=result.block_hashes,
            block_size_tokens=self._preprocessor.info.block_size_tokens,
            block_hash_version=self._preprocessor.info.block_hash_version,
            cache_salt=cache_salt,
            max_tokens=result.max_tokens,
            preprocess_time_ns=time.perf_counter_ns() - start_ns,
        )


def _prompt_bytes(prompt_input: PromptInput) -> int:
    """The size the tier's byte budget would count, without validating (cheap: no scan of ids)."""
    if isinstance(prompt_input, PromptTokenIds):
        return len(prompt_input.token_ids) * MAX_TOKEN_ID_BYTES
    if isinstance(prompt_input, str):
        return num_bytes(prompt_input)
    return validation.chat_bytes(prompt_input.messages)


def _differences(preprocessor: Preprocessor, card: PreprocessCard) -> list[str]:
    """'name: the gateway's vs preprocess's' for each way the two would answer differently."""
    info = preprocessor.info
    namespace = info.hash_namespace
    own = {
        **dataclasses.asdict(BlockLayout(
            namespace.block_size_tokens, info.block_hash_version, namespace.model_fingerprint,
            namespace.tokenizer_fingerprint,
        )),
        "chat_template_fingerprint": info.chat_template_fingerprint,
    }
    tier = {**dataclasses.asdict(card.block_layout), "chat_template_fingerprint": card.chat_template_fingerprint}
    return [f"{name} {own[name]} vs {tier[name]}" for name in own if own[name] != tier[name]]
