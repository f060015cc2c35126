"""What `llmserve bench` sends: prompts of chosen token lengths, output lengths and arrival times,
all drawn from one seed, so two runs with the same flags send the same requests.

Prompts are built from the tokenizer's own whole-word tokens (" apple", "▁river"): such words
re-tokenize one to one, so a prompt asked to be 512 tokens is 512 tokens (the builder checks with
the tokenizer and trims or pads until it is). Requests in a shared-prefix group start with the
same prefix (a system prompt, in chat mode) followed by their own suffix. Each request also
carries its prompt's token ids (the text tokenized without special tokens), which is what it
sends when the prompts go as token ids: same seed, same tokens, in either form.

With `num_turns` > 1 the requests form conversations of that many turns: a turn's planned text
is only its new user message; the load generator sends it after the conversation's history (every
earlier turn and the answer the server actually gave it, see loadgen/conversation.py), so each
turn's prompt extends the one before, the way chat users reuse their own KV cache.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from tokenizers import Tokenizer

from llmserve.config_checks import check_at_least

_WHOLE_WORD = re.compile(r"^(Ġ|▁)[a-z]{3,}$")  # byte-level BPE / sentencepiece word starts
_MIN_WORD_TOKENS = 100  # fewer whole-word tokens than this: fall back to any token


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """A token length: fixed (`512`), `uniform:LOW:HIGH` or `normal:MEAN:STDDEV` (clipped >= 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "LengthDistribution":
        parts = text.split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", float(int(parts[0])))
            if len(parts) == 3 and parts[0] in ("uniform", "normal"):
                return cls(parts[0], float(parts[1]), float(parts[2]))
        except ValueError:
            pass
        raise ValueError(f"length {text!r}: expected N, uniform:LOW:HIGH or normal:MEAN:STDDEV")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return max(1, int(self.a))
        if self.kind == "uniform":
            return max(1, rng.randint(int(self.a), int(self.b)))
        return max(1, round(rng.gauss(self.a, self.b)))

    def __str__(self) -> str:
        return str(int(self.a)) if self.kind == "fixed" else f"{self.kind}:{self.a:g}:{self.b:g}"


class PromptForm(Enum):
    """How a planned prompt is sent to the gateway."""

    TEXT = "text"  # GenerateParams.prompt: tokenized by preprocess (special tokens added)
    CHAT = "chat"  # chat turns, the shared prefix as the system turn
    TOKEN_IDS = "token_ids"  # GenerateParams.prompt_token_ids: exactly the planned ids, untokenized


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    num_requests: int
    prompt_tokens: LengthDistribution
    output_tokens: LengthDistribution
    seed: int = 0
    request_rate: float | None = None  # requests/s (Poisson arrivals); None: as fast as concurrency allows
    num_prefix_groups: int = 0  # 0: no shared prefixes
    prefix_tokens: int = 0  # tokens of each group's shared prefix
    prompt_form: PromptForm = PromptForm.TEXT
    num_turns: int = 1  # turns per conversation; 1: independent requests

    def __post_init__(self) -> None:
        check_at_least("num_turns", self.num_turns, 1)


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request to send: `send_at_s` after the run starts (0 for closed-loop runs); a turn
    after a conversation's first is sent when the turn before it has ended."""

    index: int
    send_at_s: float
    prefix_group: int  # -1: no shared prefix
    prefix_text: str
    suffix_text: str  # the request's own text; in a conversation, this turn's user message
    prompt_token_ids: tuple[int, ...]  # prefix + suffix, or (turns after the first) the suffix's
    max_tokens: int
    conversation: int = 0  # requests of one conversation share it; single-turn: the index
    turn: int = 0  # 0-based position in its conversation

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class PromptBuilder:
    """Texts of exact token lengths from one tokenizer."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        words = sorted(token_id for token, token_id in vocab.items() if _WHOLE_WORD.match(token))
        self.word_ids = words if len(words) >= _MIN_WORD_TOKENS else sorted(vocab.values())

    @classmethod
    def from_path(cls, path: Path) -> "PromptBuilder":
        path = Path(path)
        return cls(Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path)))

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def text(self, num_tokens: int, rng: random.Random) -> str:
        """A text of whole words that tokenizes to exactly `num_tokens` tokens (or as close as
        the tokenizer allows: a few fix-up rounds, then the nearest)."""
        ids = [rng.choice(self.word_ids) for _ in range(num_tokens)]
        text = self.tokenizer.decode(ids)
        for _ in range(8):
            excess = self.count(text) - num_tokens
            if excess == 0:
                break
            if excess > 0:
                ids = ids[: max(1, len(ids) - excess)]
            else:
                ids += [rng.choice(self.word_ids) for _ in range(-excess)]
            text = self.tokenizer.decode(ids)
        return text

    def token_ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False).ids)


def plan_requests(config: WorkloadConfig, builder: PromptBuilder) -> list[PlannedRequest]:
    """Every request of the run, in send order, from `config.seed`. A conversation's turns are
    consecutive; its prefix group and send time are drawn at its first turn."""
    rng = random.Random(config.seed)
    prefixes = [builder.text(config.prefix_tokens, rng) for _ in range(config.num_prefix_groups)]
    send_at_s, group = 0.0, -1
    planned = []
    for index in range(config.num_requests):
        conversation, turn = divmod(index, config.num_turns)
        if turn == 0:
            if config.request_rate:
                send_at_s += rng.expovariate(config.request_rate)
            group = rng.randrange(len(prefixes)) if prefixes else -1
        prefix = prefixes[group] if prefixes else ""
        num_prefix_tokens = config.prefix_tokens if prefixes and turn == 0 else 0
        num_suffix_tokens = max(1, config.prompt_tokens.sample(rng) - num_prefix_tokens)
        suffix = builder.text(num_suffix_tokens, rng)
        joined = f"{prefix}{suffix}" if prefix and turn == 0 else suffix
        planned.append(PlannedRequest(
            index=index, send_at_s=send_at_s if config.request_rate and turn == 0 else 0.0, prefix_group=group,
            prefix_text=prefix, suffix_text=suffix, prompt_token_ids=builder.token_ids(joined),
            max_tokens=config.output_tokens.sample(rng), conversation=conversation,
            turn=turn,
        ))
    return planned
