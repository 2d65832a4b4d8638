"""``LoopbackListener``: a ``CaptureHub`` in this process on a loopback port.

The in-process gateway hands each episode an ``http_client`` that reaches the hub with no
socket (``capture.gateways.CaptureTransport``). Agents that ignore it (AReaL documents the
client as optional; many agents build ``openai.AsyncOpenAI(base_url=...)`` themselves)
make plain HTTP requests to the base URL instead, so that URL must answer too: this
listener serves the hub's routes (``CaptureHub.dispatch``) over HTTP/1.1 on
``127.0.0.1``, parsed by ``h11`` (httpx's own HTTP/1.1 parser). It is small on purpose:
keep-alive, ``Content-Length`` and chunked request bodies, chunked server-sent events for
``stream: true``; anything malformed is answered 400 and the connection closed.

``LocalGateway`` starts it with its first open episode and stops it with its last, so a
worker holds no port between groups and nothing outlives the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import h11
import structlog

from rollq.producers.inference.capture.hub import CaptureHub, GatewayReply

log = structlog.get_logger("rollq.capture")

_READ_BYTES = 65536
_ACCEPT_TURNS = 2
"""Loop turns from a connection's accept to its protocol (``_accepted``), at most (1 in
CPython 3.11's selector loop); ``aclose`` waits them out, then for the handlers."""
_HANDLER_TURNS = 20
"""Loop turns ``aclose`` waits at most for accepted connections' handlers to start."""


class LoopbackListener:
    """Serves ``hub`` on ``host`` (module docstring); ``port`` is the kernel's choice."""

    def __init__(self, hub: CaptureHub, *, host: str = "127.0.0.1") -> None:
        self.hub = hub
        self.host = host
        self.port = 0
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._starting = 0  # connections accepted whose handler has not run yet

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        # a bound socket of our own: asyncio would resolve the host name in a thread first
        # (getaddrinfo), a thread hop per group on a busy worker
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, 0))
            loop = asyncio.get_running_loop()
            self._server = await loop.create_server(self._accepted, sock=sock)
        except BaseException:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        log.debug("capture_listener_started", url=self.url)

    async def aclose(self) -> None:
        """Stop listening and end every open connection (an agent's idle keep-alive ones
        included: the listener's lifetime is the episodes', not the agent's clients')."""
        await asyncio.shield(self._close())  # all of it, even when the caller is cancelled

    async def _close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            # Accept nothing more, then let the connections already accepted reach their
            # handlers (closed below with the rest): asyncio makes a connection's transport
            # a loop turn after its accept, and a server closed in that turn leaves the
            # socket open to the garbage collector (Python 3.11: ``Server._attach`` fails)
            try:
                asyncio.get_running_loop().remove_reader(server.sockets[0].fileno())
                for turn in range(_HANDLER_TURNS):
                    if turn >= _ACCEPT_TURNS and not self._starting:
                        break
                    await asyncio.sleep(0)
            finally:
                server.close()  # the listening socket: closed whatever happens above
            await server.wait_closed()
        for writer in list(self._connections.values()):
            writer.close()  # its handler reads the end of the stream and returns
        await asyncio.gather(*self._connections, return_exceptions=True)

    def _accepted(self) -> asyncio.StreamReaderProtocol:
        """``asyncio.start_server``'s protocol for an accepted connection, counted until
        its handler starts (``aclose`` waits for it)."""
        self._starting += 1
        return asyncio.StreamReaderProtocol(asyncio.StreamReader(limit=_READ_BYTES),
                                            self._serve)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._starting -= 1
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        connection = h11.Connection(h11.SERVER)
        try:
            while await self._answer_one(connection, reader, writer):
                connection.start_next_cycle()
        except (ConnectionError, h11.ProtocolError, asyncio.IncompleteReadError) as exc:
            log.debug("capture_listener_connection_dropped", error=f"{type(exc).__name__}")
        finally:
            self._connections.pop(task, None)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _answer_one(self, connection: h11.Connection, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> bool:
        """Read one request and answer it; whether the connection may serve another."""
        try:
            read = await _read_request(connection, reader)
        except h11.RemoteProtocolError:
            with contextlib.suppress(h11.LocalProtocolError):
                await self._send(connection, writer, _bad_request())
            return False
        if read is None:
            return False
        request, body = read
        path = request.target.decode("latin-1").split("?", 1)[0]
        try:
            reply = await self.hub.dispatch(request.method.decode("ascii"), path, body)
        except Exception as exc:  # a bug behind the hub: the agent sees a 500, we log it
            log.exception("capture_listener_request_failed", path=path)
            reply = GatewayReply(status=500, body={"error": {
                "message": f"{type(exc).__name__}: {exc}", "type": "internal_error",
                "param": None, "code": 500}})
        await self._send(connection, writer, reply)
        return connection.our_state is h11.DONE and connection.their_state is h11.DONE

    async def _send(self, connection: h11.Connection, writer: asyncio.StreamWriter,
                    reply: GatewayReply) -> None:
        if reply.events is not None:
            headers = [("content-type", "text/event-stream"), ("transfer-encoding", "chunked")]
            writer.write(connection.send(h11.Response(status_code=reply.status,
                                                      headers=headers)) or b"")
            async for chunk in reply.events:
                writer.write(connection.send(h11.Data(data=chunk)) or b"")
                await writer.drain()
        else:
            content = reply.content()
            headers = [("content-type", reply.headers.get("content-type", "application/json")),
                       ("content-length", str(len(content)))]
            writer.write(connection.send(h11.Response(status_code=reply.status,
                                                      headers=headers)) or b"")
            writer.write(connection.send(h11.Data(data=content)) or b"")
        writer.write(connection.send(h11.EndOfMessage()) or b"")
        await writer.drain()


async def _read_request(connection: h11.Connection, reader: asyncio.StreamReader
                        ) -> tuple[h11.Request, bytes] | None:
    """The next request and its body; None when the client closed the connection."""
    request: h11.Request | None = None
    body = bytearray()
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            connection.receive_data(await reader.read(_READ_BYTES))
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage) and request is not None:
            return request, bytes(body)
        elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
            return None


def _bad_request() -> GatewayReply:
    return GatewayReply(status=400, body={"error": {
        "message": "malformed HTTP request", "type": "invalid_request_error", "param": None,
        "code": 400}})
