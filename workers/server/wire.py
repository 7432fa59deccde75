"""uvicorn's HTTP/1.1 protocol, with the 400 it answers itself in JSON.

A request uvicorn cannot parse (a malformed request line or header, a URL
or head past the parser's limits) never reaches the app: uvicorn answers 400
with ``text/plain`` and closes the connection. Every other error the worker
gives is OpenAI's JSON shape (``workers/openai_error.py``), and clients and
the gateway parse error bodies as JSON; this subclass makes that 400 one of
them. httptools is the parser uvicorn[standard] brings and its
``http="auto"`` picks.

It also closes as nginx's lingering close does: the reply and our end of the
stream are sent, and what the client is still sending is read and dropped
for a moment. Closing at once with unread bytes (the rest of a 200 KB URL)
makes the kernel answer with a reset, which can destroy the reply before the
client reads it.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from workers.openai_error import ApiError

CODE = "invalid_http"
# After a refusal, how long and how much of the client's rest is read and dropped.
LINGER_SECONDS = 2.0
LINGER_MAX_BYTES = 1 << 20


class JsonErrorsHttpTools(HttpToolsProtocol):
    lingering = -1  # bytes dropped since the refusal; -1 before one

    def data_received(self, data: bytes) -> None:
        if self.lingering < 0:
            super().data_received(data)
            return
        self.lingering += len(data)
        if self.lingering > LINGER_MAX_BYTES:
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        body = ApiError(msg, code=CODE).encode()  # msg: "Invalid HTTP request received."
        head = [b"HTTP/1.1 400 Bad Request\r\n"]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        self.transport.write(b"".join(head) + body)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.lingering = 0
        self.transport.write_eof()
        self.loop.call_later(LINGER_SECONDS, self.transport.close)
