"""Several prompts of one OpenAI completions request (`prompt: [...]`), generated at once and
answered as one: prompt i's sequence j becomes choice i x n + j, as OpenAI numbers them.

Each prompt is a request of its own through the pipeline (preprocess, routing, admission, its
own KV blocks), so they run concurrently on whichever replicas the router picks. Their deltas
meet in a small bounded queue: a client that reads slowly holds the generations back (their
replica buffers fill and the slow-reader bounds apply), instead of the queue taking everything.
The first error ends the whole answer and closes the other generations (their inference
requests are aborted, their KV blocks freed).
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import AsyncIterator

from llmserve.gateway.generation import GenerationDelta

# Deltas waiting per prompt before its generation waits for the client.
_QUEUED_PER_PROMPT = 4


class _Ended:
    """A prompt's generation ended: normally (error None) or with an error."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None):
        self.error = error


async def merged_deltas(generations: list[AsyncIterator[GenerationDelta]], n: int) -> AsyncIterator[GenerationDelta]:
    """The generations' deltas as one stream, renumbered; ends when every generation has."""
    if len(generations) == 1:
        async with aclosing(generations[0]) as only:
            async for delta in only:
                yield delta
        return
    queue: asyncio.Queue[GenerationDelta | _Ended] = asyncio.Queue(maxsize=_QUEUED_PER_PROMPT * len(generations))

    async def pump(offset: int, generation: AsyncIterator[GenerationDelta]) -> None:
        error: BaseException | None = None
        try:
            async with aclosing(generation):
                async for delta in generation:
                    delta.sequence_index += offset
                    await queue.put(delta)
        except asyncio.CancelledError:
            raise  # closed by the consumer: nobody reads an end marker
        except Exception as exc:  # noqa: BLE001 — handed to the consumer, which raises it
            error = exc
        await queue.put(_Ended(error))

    tasks = [asyncio.ensure_future(pump(index * n, generation)) for index, generation in enumerate(generations)]
    try:
        num_running = len(tasks)
        while num_running:
            item = await queue.get()
            if isinstance(item, _Ended):
                num_running -= 1
                if item.error is not None:
                    raise item.error
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
