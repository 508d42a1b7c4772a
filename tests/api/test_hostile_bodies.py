"""Bodies that hide their size: a multipart offer sent chunked (no Content-Length), cut into
many parts each under the per-part limit, 100 MiB in all. It is refused with 413 once the 25 MiB
cap is passed (before, every part was parsed and spooled), and the server goes on serving. Real
server, raw HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx

from duplex.api.errors import MAX_BODY_BYTES
from harness.server import ServerProcess
from tests.api.helpers import AUTH, SHORT_ANSWER

PART = 512 << 10  # under Starlette's 1 MiB part limit


async def parts(total: int) -> AsyncIterator[bytes]:
    yield b'--b\r\nContent-Disposition: form-data; name="sdp"\r\n\r\nv=0\r\n'
    for i in range(total // PART):
        yield (f'--b\r\nContent-Disposition: form-data; name="filler{i}"\r\n\r\n'.encode()
               + b"a" * PART + b"\r\n")
    yield b"--b--\r\n"


async def test_a_chunked_multipart_offer_over_the_cap_gets_413(server: ServerProcess) -> None:
    headers = {**AUTH, "Content-Type": "multipart/form-data; boundary=b"}
    async with httpx.AsyncClient(headers=headers, timeout=60) as http:
        response = await http.post(f"{server.url}/v1/realtime/calls",
                                   content=parts(4 * MAX_BODY_BYTES))
        assert response.status_code == 413, response.text
        assert "larger than" in response.json()["error"]["message"]
        # The server goes on: a chat answer right after.
        answer = await http.post(f"{server.url}/v1/chat/completions", headers={
            "Content-Type": "application/json"}, json={
            "model": "m", "messages": [{"role": "user", "content": "Hello"}],
            "max_completion_tokens": SHORT_ANSWER})
        assert answer.status_code == 200, answer.text
