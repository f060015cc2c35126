"""A multi-turn conversation as the load generator replays it: each turn's prompt is the
conversation so far (every earlier user message and the answer the server actually streamed
back for it) followed by the turn's new user message.

The answer is the server's own output, not a planned text, so the prompt of turn k+1 starts
with exactly the tokens turn k left in the replica's KV cache (as token ids; as text or chat the
answer is re-tokenized by preprocess, and a chat template adds its own markers): what a prefix
cache and KV-aware routing can reuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.tools.loadgen.workload import PlannedRequest, PromptForm
from llmserve.v1 import gateway_pb2


@dataclass(slots=True)
class Exchange:
    """One finished turn: what was sent as new, and what came back."""

    user_text: str
    user_token_ids: tuple[int, ...]
    answer_text: str
    answer_token_ids: tuple[int, ...]


@dataclass(slots=True)
class Conversation:
    system_text: str  # the shared prefix ("" when none)
    exchanges: list[Exchange] = field(default_factory=list)

    def add(self, planned: PlannedRequest, answer_text: str, answer_token_ids: tuple[int, ...]) -> None:
        self.exchanges.append(Exchange(planned.suffix_text, planned.prompt_token_ids, answer_text, answer_token_ids))

    def fill_prompt(self, params: gateway_pb2.GenerateParams, planned: PlannedRequest, form: PromptForm) -> None:
        """Set the prompt of `planned` (this conversation's next turn) on `params`."""
        if form is PromptForm.CHAT:
            for role, content in self.chat_messages(planned):
                params.chat.messages.add(role=role, content=content)
        elif form is PromptForm.TOKEN_IDS:
            params.prompt_token_ids.token_ids.extend(self.prompt_token_ids(planned))
        else:
            params.prompt = self.prompt_text(planned)

    def chat_messages(self, planned: PlannedRequest) -> list[tuple[str, str]]:
        """(role, content) of every turn so far and the new user message, the prefix as the system turn."""
        messages = [("system", self.system_text)] if self.system_text else []
        for exchange in self.exchanges:
            messages += [("user", exchange.user_text), ("assistant", exchange.answer_text)]
        return [*messages, ("user", planned.suffix_text)]

    def prompt_token_ids(self, planned: PlannedRequest) -> list[int]:
        ids: list[int] = []
        for exchange in self.exchanges:
            ids += exchange.user_token_ids
            ids += exchange.answer_token_ids
        return [*ids, *planned.prompt_token_ids]

    def prompt_text(self, planned: PlannedRequest) -> str:
        history = "".join(e.user_text + e.answer_text for e in self.exchanges)
        return self.system_text + history + planned.suffix_text
