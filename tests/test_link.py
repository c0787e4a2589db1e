"""The emulated link (``presto_sd.app.bench.link``): bytes intact, delayed, and cut on demand."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from presto_sd.app.bench.link import DelayLink
from presto_sd.embedded.hf_verifier import HFVerifier
from presto_sd.engine.messages import VerifierUnavailableError
from tests.rpc_util import LocalServer
from verifier_service.remote import RemoteVerifier


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()
    writer.close()


async def _round_trip(port: int, payload: bytes) -> tuple[bytes, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    writer.write(payload)
    await writer.drain()
    got = await reader.readexactly(len(payload))
    elapsed = time.monotonic() - t0
    writer.close()
    return got, elapsed


def test_bytes_arrive_intact_after_the_delay_and_a_cut_drops_and_refuses():
    async def scenario() -> None:
        echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
        link = DelayLink(("127.0.0.1", echo.sockets[0].getsockname()[1]), one_way_s=0.02)
        port = await link.start()
        try:
            payload = bytes(range(256)) * 4096  # 1 MiB, in many chunks
            got, elapsed = await _round_trip(port, payload)
            assert got == payload and elapsed >= 0.04  # two one-way delays at least
            small, rtt = await _round_trip(port, b"ping")
            assert small == b"ping" and 0.04 <= rtt < 0.5
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"x")
            assert await reader.readexactly(1) == b"x"
            link.cut()  # the open connection drops ...
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                writer.write(b"y")
                await writer.drain()
                await asyncio.wait_for(reader.readexactly(1), 2)
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):  # ... new ones too
                await asyncio.wait_for(_round_trip(port, b"z"), 2)
            link.restore()
            assert (await _round_trip(port, b"back"))[0] == b"back"
        finally:
            await link.stop()
            echo.close()

    asyncio.run(scenario())


def test_a_grpc_verifier_through_the_link(tiny_target):
    """A real server behind the link: calls pay the round trip, a cut is UNAVAILABLE, and
    after the link is restored the same client goes on."""
    server = LocalServer("verifier").start(HFVerifier(tiny_target, (0, 2)))
    loop = asyncio.new_event_loop()
    link = DelayLink(("127.0.0.1", int(server.address.rsplit(":", 1)[1])), one_way_s=0.01)
    port = loop.run_until_complete(link.start())
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()

    def on_loop(fn) -> None:  # run fn on the link's loop and wait until it has run
        async def call() -> None:
            fn()
        asyncio.run_coroutine_threadsafe(call(), loop).result(5)

    remote = RemoteVerifier(f"127.0.0.1:{port}", timeout_s=5)
    try:
        remote.info()
        t0 = time.monotonic()
        remote.info(fresh=True)
        assert time.monotonic() - t0 >= 0.02
        pre = remote.prefill("s", [1, 2, 3])
        assert 0.02 <= remote.round_trip_s() < 0.2  # the client measures the link, not the engine
        on_loop(link.cut)
        for _ in range(3):  # a few failed dials: the channel's backoff grows to its cap
            with pytest.raises(VerifierUnavailableError):
                remote.step("s", pre.base, pre.anchor)
            time.sleep(0.5)
        on_loop(link.restore)
        restored = time.monotonic()
        while True:  # the channel reconnects on its own
            try:
                res = remote.step("s", pre.base, pre.anchor)
                break
            except VerifierUnavailableError:
                if time.monotonic() > restored + 20:
                    raise
                time.sleep(0.05)
        redial_s = time.monotonic() - restored
        assert res.base == pre.base + 1
        # the claim "re-dials within about a second": the backoff is capped at 1 s (+-20 %
        # jitter); measured 0.08-0.59 s on this 2-core machine under the suite's load
        # (2026-12-03); 3 s leaves room for a slower one
        assert redial_s < 3.0, redial_s
    finally:
        remote.shutdown()
        asyncio.run_coroutine_threadsafe(link.stop(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        server.stop()


def test_the_relay_process_delays_cuts_and_restores():
    """The relays a benchmark runs beside itself: their own process, driven over stdin."""
    from presto_sd.app.bench.link import RelayProcess

    async def serve_echo(ready: threading.Event, box: list) -> None:
        echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
        box.append(echo.sockets[0].getsockname()[1])
        ready.set()
        await asyncio.sleep(30)

    ready, box = threading.Event(), []
    threading.Thread(target=lambda: asyncio.run(serve_echo(ready, box)), daemon=True).start()
    ready.wait(5)
    relay = RelayProcess({"echo": ("127.0.0.1", box[0])})
    try:
        port = int(relay.addresses["echo"].rsplit(":", 1)[1])
        relay.set_rtt(0.03)
        got, rtt = asyncio.run(_round_trip(port, b"ping"))
        assert got == b"ping" and 0.03 <= rtt < 0.5
        relay.cut("echo")
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            asyncio.run(asyncio.wait_for(_round_trip(port, b"z"), 2))
        relay.restore("echo")
        assert asyncio.run(_round_trip(port, b"back"))[0] == b"back"
    finally:
        relay.close()
    assert relay.proc.returncode == 0
