"""An emulated network link for benchmarks: a TCP relay that delays every byte, and can be cut.

    relay = DelayLink(("127.0.0.1", 50052), one_way_s=0.001)   # +2 ms of round trip
    port = await relay.start()     # clients dial 127.0.0.1:port instead of the server
    relay.cut()                    # every connection drops; new ones are refused ...
    relay.restore()                # ... until the link is back

A benchmark runs its relays in a process of their own (``RelayProcess``), so that relaying
never competes with the loop it measures for one interpreter lock:

    python -m presto_sd.app.bench.link drafter=10.77.1.2:50051 verifier=10.77.2.2:50051
    -> {"ports": {"drafter": 41234, "verifier": 41235}}; then, a line each on stdin:
       "rtt SECONDS" | "cut NAME" | "restore NAME", each answered "ok"; EOF stops it.

Where the kernel has ``tc netem`` a qdisc on a veth is the usual tool; this machine's
kernel has no qdiscs at all (``tc qdisc add ... netem``: "Specified qdisc kind is
unknown"), so the delay lives in user space. Each direction's bytes are held
``one_way_s`` from when they arrive and then written in order: a latency, not a bandwidth
limit (on loopback or a veth pair the bytes themselves are nearly free). Both sockets
set TCP_NODELAY, as gRPC does, so small messages are not held back by Nagle's algorithm.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time

from presto_sd.app.errors import FlagError

_CHUNK = 1 << 16


class DelayLink:
    def __init__(self, target: tuple[str, int], one_way_s: float = 0.0, host: str = "127.0.0.1") -> None:
        if one_way_s < 0:
            raise FlagError(f"one_way_s {one_way_s}: must be >= 0")
        self.target, self.one_way_s, self.host = target, one_way_s, host
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.up = True
        self.bytes_relayed = 0

    async def start(self, port: int = 0) -> int:
        """Listen on ``host:port`` (0: any free port); the port clients should dial."""
        self._server = await asyncio.start_server(self._connection, self.host, port)
        return self._server.sockets[0].getsockname()[1]

    def cut(self) -> None:
        """Drop every connection now and refuse new ones (a cable pulled)."""
        self.up = False
        for w in list(self._writers):
            w.transport.abort()

    def restore(self) -> None:
        self.up = True

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.up:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        for w in (writer, up_writer):
            _nodelay(w)
            self._writers.add(w)
        pipes = [asyncio.create_task(self._pipe(reader, up_writer)),
                 asyncio.create_task(self._pipe(up_reader, writer))]
        self._pipes.update(pipes)
        try:
            await asyncio.gather(*pipes, return_exceptions=True)
        finally:
            self._pipes.difference_update(pipes)
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Bytes from ``reader`` to ``writer``, each chunk ``one_way_s`` after it arrived."""
        held: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while (item := await held.get()) is not None:
                due, data = item
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
                self.bytes_relayed += len(data)
            with contextlib.suppress(OSError):
                writer.write_eof()

        sender = asyncio.create_task(deliver())
        try:
            while data := await reader.read(_CHUNK):
                held.put_nowait((time.monotonic() + self.one_way_s, data))
            held.put_nowait(None)
            await sender
        finally:
            sender.cancel()


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _serve(targets: dict[str, tuple[str, int]]) -> None:
    links = {name: DelayLink(target) for name, target in targets.items()}
    ports = {name: await link.start() for name, link in links.items()}
    print(json.dumps({"ports": ports}), flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        verb, _, arg = line.strip().partition(" ")
        if verb == "rtt":
            for link in links.values():
                link.one_way_s = float(arg) / 2
        elif verb in ("cut", "restore"):
            getattr(links[arg], verb)()
        print("ok", flush=True)
    for link in links.values():
        await link.stop()


class RelayProcess:
    """``DelayLink`` relays in a child process: ``addresses`` to dial, set_rtt / cut / restore."""

    def __init__(self, targets: dict[str, tuple[str, int]]) -> None:
        argv = [f"{name}={host}:{port}" for name, (host, port) in targets.items()]
        self.proc = subprocess.Popen([sys.executable, "-m", "presto_sd.app.bench.link", *argv],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ports = json.loads(self.proc.stdout.readline())["ports"]
        self.addresses = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
        self._lock = threading.Lock()  # a timer thread restores while the loop's thread cuts

    def _say(self, line: str) -> None:
        with self._lock:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
            if self.proc.stdout.readline().strip() != "ok":
                raise RuntimeError(f"relay: no answer to {line!r}")

    def set_rtt(self, rtt_s: float) -> None:
        self._say(f"rtt {rtt_s}")

    def cut(self, name: str) -> None:
        self._say(f"cut {name}")

    def restore(self, name: str) -> None:
        self._say(f"restore {name}")

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


if __name__ == "__main__":
    pairs = (arg.split("=", 1) for arg in sys.argv[1:])
    asyncio.run(_serve({name: (addr.rsplit(":", 1)[0], int(addr.rsplit(":", 1)[1])) for name, addr in pairs}))
