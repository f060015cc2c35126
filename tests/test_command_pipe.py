"""CommandPipe: commands written from the event loop arrive whole and in order through a pipe
that fills up, as multiprocessing.Connection.recv reads them; a pipe whose reader is gone
drops them without raising."""

import asyncio
import multiprocessing
import threading

from llmserve.inference.engine.command_pipe import CommandPipe

BIG = 100_000  # ints: a pickled command of ~300 KB, several times a pipe's 64 KiB buffer


async def _send_all(pipe: CommandPipe, commands: list) -> None:
    for command in commands:
        pipe.send(command)  # never blocks: what the pipe does not take waits in the buffer
    while pipe.num_unwritten_bytes:
        await asyncio.sleep(0.01)


def test_commands_arrive_whole_and_in_order_through_a_full_pipe():
    reader, writer = multiprocessing.Pipe(duplex=False)
    commands = [("add", i, list(range(i, i + (BIG if i % 3 == 0 else 10)))) for i in range(12)]
    received = []

    async def main():
        pipe = CommandPipe(writer, asyncio.get_running_loop())
        pipe.send(commands[0])
        assert pipe.num_unwritten_bytes > 0  # the first big one already overflowed the pipe
        # The reader starts only now: until then the loop must stay free (the sends returned).
        receiving = threading.Thread(target=lambda: received.extend(reader.recv() for _ in commands))
        receiving.start()
        await _send_all(pipe, commands[1:])
        await asyncio.to_thread(receiving.join)

    asyncio.run(main())
    assert received == commands


def test_a_pipe_whose_reader_is_gone_drops_commands():
    reader, writer = multiprocessing.Pipe(duplex=False)
    reader.close()

    async def main():
        pipe = CommandPipe(writer, asyncio.get_running_loop())
        pipe.send(("add", 1, [1, 2, 3]))
        pipe.send(("add", 2, list(range(BIG))))
        assert pipe.num_unwritten_bytes == 0

    asyncio.run(main())
