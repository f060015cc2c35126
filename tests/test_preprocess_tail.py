"""Tail tokenization: a chat tokenized on top of a cached prefix gives exactly the ids of tokenizing
it whole, on many random multi-turn conversations, on four real tokenizers (the tiny byte-level
BPE under ChatML and under a template whose seams fall inside text, a SentencePiece-style one,
and Qwen3's where available), both through the BatchEncoder and through a real server."""

from __future__ import annotations

import random
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import tokenizers

from llmserve.preprocessing.batch_encoder import EncodeJob
from llmserve.preprocess.config import PreprocessConfig
from llmserve.prompt_input import Chat
from llmserve.preprocessing.preprocessor import Preprocessor
from llmserve.preprocess.server import start_server
from llmserve.sampling import ChatMessage
from llmserve.server import CHANNEL_OPTIONS
from llmserve.v1 import common_pb2, preprocess_pb2, preprocess_pb2_grpc
from tests.preprocess_models import SEAMLESS_TEMPLATE, metaspace_model_dir, qwen3_model_dir, with_template

# Pieces that merge or compose with their neighbours: runs of spaces and newlines, a combining
# accent, a zero-width joiner between emoji, CJK and digits (multi-byte, grouped), words split
# mid-merge, contractions, and text that looks like (or is) a special token.
PIECES = [
    "hel", "lo", " world", "  ", " ", "\n", "\n\n", "\r\n", "\t", "e", "\u0301", "é", "東京", "北",
    "🙂", "👨", "\u200d👩", "12", "345", "'s", "'re", "ﬁ", "...", "—", "x" * 12, "<|im_", "|>",
    "<|im_end|>", "<think>", "</think>", "Paris", "ñ",
]
NUM_CONVERSATIONS = 40
MAX_MESSAGES = 7


def _content(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 8)))


def random_conversation(rng: random.Random) -> list[ChatMessage]:
    """An optional system prompt (one of two, so conversations share them), then user and
    assistant turns alternating."""
    messages = [ChatMessage("system", rng.choice(["You are terse. 東京\n", "Be kind  "]))] if rng.random() < 0.6 else []
    roles = ("user", "assistant")
    messages += [ChatMessage(roles[i % 2], _content(rng)) for i in range(rng.randint(1, MAX_MESSAGES))]
    return messages


def conversation_turns(messages: list[ChatMessage]) -> list[Chat]:
    """The requests a client sends as the conversation grows: after each user turn (asking for a
    reply) and after each assistant turn (a chat given as it is)."""
    start = 1 if messages[0].role == "system" else 0
    return [
        Chat(tuple(messages[: end + 1]), add_generation_prompt=messages[end].role == "user")
        for end in range(start, len(messages))
    ]


@pytest.fixture(scope="module", params=["chatml", "seamless", "metaspace", "qwen3"])
def model_dir(request, tiny_model_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp(f"tail-{request.param}")
    if request.param == "chatml":
        return tiny_model_dir
    if request.param == "seamless":
        return with_template(tiny_model_dir, root / "model", SEAMLESS_TEMPLATE)
    if request.param == "metaspace":
        return metaspace_model_dir(root / "model")
    return qwen3_model_dir(root / "model")


def _load(model_dir: Path) -> tuple[Preprocessor, tokenizers.Tokenizer]:
    config = PreprocessConfig(model_path=model_dir, max_prompt_bytes=10_000_000)
    return Preprocessor.load(config.model_path, config.preprocessor_settings), tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_tail_tokenization_equals_full_tokenization_on_random_conversations(model_dir):
    preprocessor, reference = _load(model_dir)
    assert preprocessor.tail.is_enabled
    rng = random.Random(10)
    conversations = [conversation_turns(random_conversation(rng)) for _ in range(NUM_CONVERSATIONS)]
    previous: list = [None] * len(conversations)  # each conversation's last turn, tokenized
    systems: dict[str, object] = {}  # system prompt -> its tokenized prefix
    num_spliced = num_naive_wrong = 0
    for turn in range(max(len(c) for c in conversations)):
        live = [i for i, turns in enumerate(conversations) if turn < len(turns)]
        jobs = []
        for i in live:
            chat = conversations[i][turn]
            system = systems.get(chat.messages[0].content) if chat.messages[0].role == "system" else None
            prefixes = tuple(p for p in (previous[i], system) if p is not None)
            needs_system = chat.messages[0].role == "system" and system is None and len(chat.messages) > 1
            jobs.append(EncodeJob(chat, False, lambda encoding: encoding, prefixes, make_system_prefix=needs_system))
        # One batch per turn: every conversation at this turn, spliced or not, tokenized together.
        for i, job, encoded in zip(live, jobs, preprocessor.encoder.encode_batch(jobs), strict=True):
            encoding = encoded.result
            full = reference.encode(encoding.rendered_prompt, add_special_tokens=False).ids
            assert encoding.token_ids == full, (job.text_or_chat, [p.text for p in job.prefixes])
            if encoding.num_reused_ids:
                num_spliced += 1
                base = next(p for p in job.prefixes if encoding.rendered_prompt.startswith(p.text))
                tail = encoding.rendered_prompt[len(base.text) :]
                naive = base.token_ids + reference.encode(tail, add_special_tokens=False).ids
                num_naive_wrong += naive != full
            previous[i] = encoded.prefix
            if encoded.system_prefix is not None:
                systems[job.text_or_chat.messages[0].content] = encoded.system_prefix
    num_requests = sum(len(c) for c in conversations)
    assert num_spliced >= num_requests // 2, (num_spliced, num_requests)
    if model_dir.parent.name.startswith("tail-seamless"):
        # The seamless template's seams fall inside text: prefix ids + the tail's ids tokenized
        # alone would have been wrong for some of them, and the backed-off splice never was.
        assert num_naive_wrong > 0


def test_a_splice_whose_window_does_not_start_with_the_anchor_is_refused(tiny_model_dir):
    preprocessor, _ = _load(tiny_model_dir)
    tail = preprocessor.tail
    prefix = tail.prefix("<|im_start|>user\nhi", preprocessor.tokenizer.encode("<|im_start|>user\nhi", add_special_tokens=False))
    assert prefix.seam is not None and prefix.seam.text_offset == 0 and prefix.seam.num_kept_ids == 0
    assert tail.window("<|im_start|>user\nhi there", prefix) == "<|im_start|>user\nhi there"
    assert tail.window("<|im_start|>user\nHI", prefix) is None  # not a prefix of the new text
    assert tail.splice(prefix, preprocessor.tokenizer.encode("hi there", add_special_tokens=False)) is None
    # A boundary token that occurs as text without being matched as the token gives no seam.
    mismatched = tail.prefix("<|im_start|>user", preprocessor.tokenizer.encode("user", add_special_tokens=False))
    assert mismatched.seam is None


@pytest_asyncio.fixture(loop_scope="session")
async def stub(model_dir):
    config = PreprocessConfig(model_path=model_dir, port=0, max_prompt_bytes=10_000_000, num_tokenizer_threads=2)
    server = await start_server(config)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=CHANNEL_OPTIONS)
    yield preprocess_pb2_grpc.PreprocessServiceStub(channel)
    await channel.close()
    await server.running.server.stop(1.0)
    await server.close()


def _chat_pb(chat: Chat) -> common_pb2.ChatInput:
    messages = [common_pb2.ChatMessage(role=m.role, content=m.content) for m in chat.messages]
    return common_pb2.ChatInput(messages=messages, add_generation_prompt=chat.add_generation_prompt)


@pytest.mark.asyncio(loop_scope="session")
async def test_a_server_answers_growing_conversations_with_full_tokenizations(stub, model_dir):
    reference = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(11)
    for _ in range(NUM_CONVERSATIONS // 2):
        for chat in conversation_turns(random_conversation(rng)):
            tokenized = await stub.Tokenize(preprocess_pb2.TokenizeRequest(chat=_chat_pb(chat)), timeout=30)
            full = reference.encode(tokenized.rendered_prompt, add_special_tokens=False).ids
            assert list(tokenized.token_ids) == full, chat
            preprocessed = await stub.Preprocess(
                preprocess_pb2.PreprocessRequest(chat=_chat_pb(chat), max_tokens=1), timeout=30
            )
            assert list(preprocessed.token_ids) == full
