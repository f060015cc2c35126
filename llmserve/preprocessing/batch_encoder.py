"""Tokenize a micro-batch of inputs in as few calls into Rust as it takes (runs on a tokenizer thread).

Per batch:
  1. each chat is rendered (and held to the byte cap); a chat that the prompt cache found a
     prefix for keeps only a window to tokenize (TailTokenizer), and one whose system prompt has
     no entry yet renders that prompt alone too, so that the entry can be made;
  2. every text, window and system prompt is tokenized together, one `encode_batch` per
     add_special_tokens value;
  3. windows are spliced onto their prefix's ids; a splice that is refused is tokenized in
     full (a second `encode_batch`, for those only);
  4. each job's `finish` runs on its ids (the pipeline's steps after tokenization).
A job that fails (a template that rejects the chat, a rendered chat over the cap, a prompt over
the context) gets its own exception; the others in the batch are not affected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

from llmserve.client_text import num_bytes
from llmserve.errors import InvalidArgument
from llmserve.preprocessing import validation
from llmserve.preprocessing.chat_template import ChatTemplate
from llmserve.prompt_input import Chat, TextOrChat
from llmserve.preprocessing.tail_tokenizer import TailTokenizer, TokenizedPrefix
from llmserve.preprocessing.tokenizer import ModelTokenizer
from llmserve.preprocessing.validation import Limits

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Encoding:
    token_ids: list[int]
    rendered_prompt: str  # the rendered chat; "" for text input
    num_reused_ids: int  # ids taken from a cached prefix instead of tokenized


@dataclass(frozen=True, slots=True)
class EncodeJob(Generic[R]):
    text_or_chat: TextOrChat
    add_special_tokens: bool  # text only: a rendered chat holds its special tokens as text
    finish: Callable[[Encoding], R]  # run on the tokenizer thread once the ids are known
    prefixes: tuple[TokenizedPrefix, ...] = ()  # cached leading runs of the chat, longest first
    make_system_prefix: bool = False  # render and tokenize the system prompt alone too


@dataclass(frozen=True, slots=True)
class Encoded(Generic[R]):
    """A job's result, and the entries the prompt cache should keep from it."""

    result: R
    prefix: TokenizedPrefix | None  # the whole chat (None for text, or without boundary tokens)
    system_prefix: TokenizedPrefix | None  # asked for by make_system_prefix and usable


@dataclass(slots=True)
class _Plan:
    """One job between the steps: what it tokenizes and, after step 2, the ids."""

    text: str  # the text, or the rendered chat
    add_special_tokens: bool
    base: TokenizedPrefix | None = None  # spliced onto: only `window` is tokenized
    window: str | None = None
    system_text: str | None = None
    token_ids: list[int] | None = None
    system_ids: list[int] | None = None


class BatchEncoder:
    """Renders and tokenizes batches of jobs. Thread-safe (no state but what it was built with)."""

    def __init__(
        self, tokenizer: ModelTokenizer, chat_template: ChatTemplate | None, limits: Limits, tail: TailTokenizer
    ):
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._limits = limits
        self._tail = tail

    def encode_batch(self, jobs: Sequence[EncodeJob]) -> list[Encoded | Exception]:
        # A job's own failure (ServiceError, or a template that fails in another way, which the
        # interceptor reports as INTERNAL) stays that job's: its batch-mates are answered.
        plans: list[_Plan | Exception] = []
        for job in jobs:
            try:
                plans.append(self._plan(job))
            except Exception as exc:
                plans.append(exc)
        live = [plan for plan in plans if isinstance(plan, _Plan)]
        self._tokenize(live)
        self._splice(live)
        outcomes: list[Encoded | Exception] = []
        for job, plan in zip(jobs, plans, strict=True):
            try:
                outcomes.append(plan if isinstance(plan, Exception) else self._finish(job, plan))
            except Exception as exc:
                outcomes.append(exc)
        return outcomes

    def render(self, chat: Chat) -> str:
        """The chat as the model sees it, held to the byte cap (a template may add text per turn)."""
        rendered = self._chat_template.render(chat.messages, add_generation_prompt=chat.add_generation_prompt)
        validation.check_prompt_bytes("chat", num_bytes(rendered), self._limits)
        return rendered

    def _plan(self, job: EncodeJob) -> _Plan:
        if isinstance(job.text_or_chat, str):
            return _Plan(job.text_or_chat, job.add_special_tokens)
        plan = _Plan(self.render(job.text_or_chat), add_special_tokens=False)
        for prefix in job.prefixes:
            if (window := self._tail.window(plan.text, prefix)) is not None:
                plan.base, plan.window = prefix, window
                return plan
        if job.make_system_prefix:
            plan.system_text = self._system_text(job.text_or_chat, plan.text)
        return plan

    def _system_text(self, chat: Chat, rendered: str) -> str | None:
        try:
            text = self._chat_template.render(chat.messages[:1], add_generation_prompt=False)
        except InvalidArgument:  # a template that wants more than a system turn: no entry
            return None
        return text if rendered.startswith(text) else None

    def _tokenize(self, plans: list[_Plan]) -> None:
        """Step 2: every text the plans need, one encode_batch per add_special_tokens value."""
        for add_special_tokens in (True, False):
            texts, sinks = [], []
            for plan in plans:
                if plan.add_special_tokens != add_special_tokens:
                    continue
                texts.append(plan.window if plan.base is not None else plan.text)
                sinks.append((plan, "token_ids"))
                if plan.system_text is not None:
                    texts.append(plan.system_text)
                    sinks.append((plan, "system_ids"))
            if texts:
                for (plan, name), ids in zip(sinks, self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)):
                    setattr(plan, name, ids)

    def _splice(self, plans: list[_Plan]) -> None:
        """Step 3: windows onto their prefixes; refused splices tokenized in full."""
        refused = []
        for plan in plans:
            if plan.base is None:
                continue
            spliced = self._tail.splice(plan.base, plan.token_ids)
            if spliced is None:
                plan.base = None
                refused.append(plan)
            else:
                plan.token_ids = spliced
        if refused:
            full = self._tokenizer.encode_batch([plan.text for plan in refused], add_special_tokens=False)
            for plan, ids in zip(refused, full, strict=True):
                plan.token_ids = ids

    def _finish(self, job: EncodeJob, plan: _Plan) -> Encoded:
        num_reused = plan.base.seam.num_kept_ids if plan.base is not None else 0
        rendered = "" if isinstance(job.text_or_chat, str) else plan.text
        result = job.finish(Encoding(plan.token_ids, rendered, num_reused))
        if not rendered or not self._tail.is_enabled:
            return Encoded(result, None, None)
        system_prefix = None
        if plan.system_ids is not None:
            system_prefix = self._tail.prefix(plan.system_text, plan.system_ids)
        return Encoded(result, self._tail.prefix(plan.text, plan.token_ids), system_prefix)
