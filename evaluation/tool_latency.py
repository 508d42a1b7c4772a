"""What the server's own tool work and a resume cost (issue 27): the time the MCP round trip and the
reconnection add to a conversation, apart from any model.

    python -m evaluation.tool_latency [--rounds 20]

A real duplex server (``python -m duplex.serve``, a subprocess, the toy model: next to no compute,
so what is left is the server's) and a real MCP server (``harness.mcp_tools``: the ``mcp`` SDK's,
streamable HTTP, in this process), both on loopback in a namespace of their own. Each round is a
new Realtime WebSocket session (raw ``websockets``, as a client would open it) that

1. connects: socket opened → ``session.created`` (``connect``);
2. offers one MCP tool (``session.update``) → ``mcp_list_tools.completed`` (``list_tools``: the
   server connects to the MCP server and lists its tools);
3. asks for a forced call of it (``response.create`` → the MCP server's tool is called:
   ``call_to_mcp``; the toy answers at once, so this is the server's path from the model's call to
   the MCP request), then the tool's reply → the first audio delta of the follow-up response that
   answers it (``mcp_reply_to_audio``: the output into the history, a new request, the toy's
   first audio);
4. drops its TCP connection (no close frame: a lost network), waits for the server to hold the
   session, and resumes it with its token: new socket → ``session.created`` of the same session
   (``resume``; against ``connect`` it is what finding the session and replaying its events adds).

A new session is opened at most 2 a second after a burst of 20 per address (the server's own
limit): a refusal is waited out and the attempt it refused is not timed.

Times are ``time.monotonic()`` of this process and the MCP handler (the same clock) and of event
arrival here. Prints p50/p90 per step and writes ``evaluation/results/tool_latency.json`` and
``.png``. Nothing here holds state between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import websockets

from evaluation.bench_common import (
    format_table,
    machine,
    run_in_loopback_namespace,
    save_figure,
    save_results,
)
from harness.mcp_tools import ToolServer, tool_app
from harness.server import ServerProcess, run_server, serving, write_preset

NAME = "tool_latency"
API_KEY = "sk-bench-tools"
TIMEOUT_S = 30.0
STEPS = ("connect", "list_tools", "call_to_mcp", "mcp_reply_to_audio", "resume")


class Client:
    """One raw Realtime WebSocket and every event it got, with when it arrived."""

    def __init__(self, ws: websockets.ClientConnection) -> None:
        self.ws = ws
        self.events: list[tuple[float, dict[str, Any]]] = []

    @classmethod
    async def open(cls, server: ServerProcess, **query: str) -> tuple[Client, float]:
        """A new socket, and when the attempt that opened it began: one address may open 2 new
        sessions a second after a burst of 20 (``AppState.new_sessions``), so a refusal (429) is
        waited out as its Retry-After says, as a client would, and not counted."""
        url = server.url.replace("http", "ws") + "/v1/realtime?model=gpt-realtime"
        url += "".join(f"&{k}={v}" for k, v in query.items())
        while True:
            began = time.monotonic()
            try:
                ws = await websockets.connect(url, max_size=None,
                                              additional_headers={"Authorization": f"Bearer {API_KEY}"})
            except websockets.InvalidStatus as refused:
                if refused.response.status_code != 429:
                    raise
                await asyncio.sleep(float(refused.response.headers.get("Retry-After", "1")))
                continue
            return cls(ws), began

    async def send(self, kind: str, **fields: Any) -> float:
        """Send one client event; when it was sent."""
        sent = time.monotonic()
        await self.ws.send(json.dumps({"type": kind, **fields}))
        return sent

    async def until(self, kind: str, count: int = 1) -> tuple[float, dict[str, Any]]:
        """The ``count``-th event of ``kind`` and when it arrived."""
        async with asyncio.timeout(TIMEOUT_S):
            while len(self.of(kind)) < count:
                event = json.loads(await self.ws.recv())
                self.events.append((time.monotonic(), event))
                if event["type"] == "error":
                    raise RuntimeError(f"server error: {event['error']}")
        return self.of(kind)[count - 1]

    def of(self, kind: str) -> list[tuple[float, dict[str, Any]]]:
        return [(t, e) for t, e in self.events if e["type"] == kind]


def _holding(server: ServerProcess) -> bool:
    """Whether the server holds a dropped session for its client (its gauge says one)."""
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).text
    for line in text.splitlines():
        if line.startswith('duplex_sessions_awaiting_resume{transport="websocket"}'):
            return float(line.rpartition(" ")[2]) == 1
    raise RuntimeError("no duplex_sessions_awaiting_resume in /metrics")


async def one_round(server: ServerProcess, tools: ToolServer) -> dict[str, float]:
    """One session through the steps of the module doc; ms per step."""
    client, opened = await Client.open(server)
    created_at, created = await client.until("session.created")
    tool = {"type": "mcp", "server_label": "bench", "server_url": f"{tools.url}/mcp",
            "allowed_tools": ["lookup"], "require_approval": "never"}
    update_at = await client.send("session.update", session={
        "type": "realtime", "output_modalities": ["audio"], "tools": [tool],
        "audio": {"input": {"turn_detection": None}}})
    listed_at, _ = await client.until("mcp_list_tools.completed")
    await client.send("conversation.item.create", item={
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Look it up."}]})
    calls = len(tools.called_at)
    asked_at = await client.send("response.create", response={
        "tool_choice": {"type": "mcp", "server_label": "bench", "name": "lookup"}})
    await client.until("response.done", 2)
    (called_at,) = tools.called_at[calls:]
    follow_up = client.of("response.created")[1][1]["response"]["id"]
    audio_at = next(t for t, e in client.of("response.output_audio.delta") if e["response_id"] == follow_up)

    client.ws.transport.abort()
    async with asyncio.timeout(TIMEOUT_S):
        while not await asyncio.to_thread(_holding, server):
            await asyncio.sleep(0.02)  # the server's view of a dropped socket: polled, across processes
    resumed, resuming = await Client.open(server, resume_token=created["session"]["resume_token"])
    resumed_at, again = await resumed.until("session.created")
    if again["session"]["id"] != created["session"]["id"]:
        raise RuntimeError("the resume gave another session")
    await resumed.ws.close()
    return {"connect": created_at - opened, "list_tools": listed_at - update_at,
            "call_to_mcp": called_at - asked_at, "mcp_reply_to_audio": audio_at - called_at,
            "resume": resumed_at - resuming}


async def measure(rounds: int, tmp: Path) -> list[dict[str, float]]:
    tools = ToolServer(url="", token=f"tok-{secrets.token_hex(8)}")
    async with serving(tool_app(tools).streamable_http_app(), "on") as port:
        tools.url = f"http://127.0.0.1:{port}"
        preset = write_preset(tmp / "preset.yaml", api_key=API_KEY,
                              session={"mcp_servers": [f"{tools.url}/"], "resume_grace_s": 30})
        with run_server(preset, tmp=tmp) as server:
            await one_round(server, tools)  # warm-up: first connections, imports
            out = []
            for _ in range(rounds):
                out.append({k: v * 1000 for k, v in (await one_round(server, tools)).items()})
        tools.release.set()
    return out


def _percentiles(values: list[float]) -> dict[str, float]:
    return {"p50": round(statistics.median(values), 1), "p90": round(float(np.percentile(values, 90)), 1)}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    data = [results["raw_ms"][step] for step in STEPS]
    ax.boxplot(data, orientation="horizontal", tick_labels=list(STEPS))
    ax.set_xlabel("ms (toy model, loopback)")
    ax.set_title(f"Tool round trip and resume, {results['rounds']} sessions")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    run_in_loopback_namespace("evaluation.tool_latency")
    with tempfile.TemporaryDirectory() as tmp:
        rows = asyncio.run(measure(args.rounds, Path(tmp)))
    raw = {step: [round(r[step], 2) for r in rows] for step in STEPS}
    summary = {step: _percentiles(raw[step]) for step in STEPS}
    print(format_table(["step", "p50 ms", "p90 ms"],
                       [[step, summary[step]["p50"], summary[step]["p90"]] for step in STEPS]))
    save_results(NAME, {"machine": machine(), "rounds": args.rounds, "ms": summary, "raw_ms": raw}, plot)


if __name__ == "__main__":
    main()
