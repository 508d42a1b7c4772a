"""The web client end to end (issue 5): Debian's Chromium, its fake microphone looping espeak speech,
talking to `python -m duplex.serve --preset toy` over real WebRTC in the loopback-only namespace.

The page connects, the server hears the speech, the agent's audio reaches the page (the decoded
remote level rises), transcript and state show in the DOM, and the next loop of speech lands on the
agent's answer: a barge-in, shown as "interrupted" with the agent's audio going quiet. A screenshot
and the server's log go to test-artifacts/.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from harness.speech import speech_wav
from tests.web.browser import (
    ARTIFACTS,
    ROOT,
    launch_chromium,
    require_loopback_only,
    screenshot,
    set_raw_microphone,
)

if not (ROOT / "duplex" / "serve.py").exists():
    pytest.skip("duplex/serve.py is not written yet: no server to drive", allow_module_level=True)

pytestmark = pytest.mark.e2e

# The fake microphone loops [0.5 s silence, speech, PAUSE_S silence]. The pause outlasts the
# server's end-of-turn silence (500 ms), so each loop is a turn, and is shorter than the toy
# preset's answer (~2.9 s of tones), so the next loop's speech lands on the answer: a barge-in.
PAUSE_S = 1.5
SPEECH = "Hello there, can you hear me?"

STARTUP_TIMEOUT_S = 120
TURN_TIMEOUT_MS = 45_000

# Records every data-state the page takes, however briefly, for the assertions and for failures.
# It watches the document: an init script runs before the <html> element exists.
STATE_RECORDER = """
window.__duplexStates = [];
new MutationObserver(() => {
  const state = document.documentElement.dataset.state;
  if (state && window.__duplexStates.at(-1) !== state) window.__duplexStates.push(state);
}).observe(document, { attributes: true, attributeFilter: ['data-state'], subtree: true });
"""


# Keeps the page's peer connections, for their statistics (getStats) in the test.
PEER_RECORDER = """
window.__duplexPeers = [];
window.RTCPeerConnection = class extends window.RTCPeerConnection {
  constructor(...args) { super(...args); window.__duplexPeers.push(this); }
};
"""
AUDIO_PACKETS_RECEIVED = """async () => {
  let packets = null;
  (await window.__duplexPeers[0].getStats()).forEach((s) => {
    if (s.type === 'inbound-rtp' && s.kind === 'audio') packets = s.packetsReceived;
  });
  return packets;
}"""
DTX_WINDOW_MS = 1000


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_healthy(base: str, server: subprocess.Popen, log_path) -> None:
    """Polls /healthz until the pipeline is ready; fails at once if the server exits."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited ({server.returncode}):\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(f"{base}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.2)
    pytest.fail(f"the server was not healthy in {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    require_loopback_only()
    ARTIFACTS.mkdir(exist_ok=True)
    log_path = ARTIFACTS / "web-e2e-server.log"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "duplex.serve", "--preset", "toy", "--port", str(port),
             "--ice-host", "127.0.0.1"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        try:
            wait_healthy(base, process, log_path)
            yield base
        finally:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    require_loopback_only()
    wav = speech_wav(SPEECH, 48000, pad_before_s=0.5, pad_after_s=PAUSE_S)
    with sync_playwright() as playwright:
        browser = launch_chromium(playwright, wav)
        yield browser
        browser.close()


def wait_for(page: Page, condition: str, what: str, arg=None, timeout_ms: int = TURN_TIMEOUT_MS):
    """Waits until the JS `condition` (a function of `arg`) holds; says what was awaited if not."""
    try:
        return page.wait_for_function(condition, arg=arg, polling=20, timeout=timeout_ms).json_value()
    except Exception as error:
        states = page.evaluate("window.__duplexStates")
        alert = page.locator("#error").inner_text()
        raise AssertionError(f"{what}: not within {timeout_ms} ms (states so far {states}, alert {alert!r})") from error


def sessions_active(base: str) -> float:
    """The server's live WebRTC sessions (CONTRACT.md metrics)."""
    metrics = httpx.get(f"{base}/metrics", timeout=5.0).text
    found = re.search(r'^duplex_sessions_active\{transport="webrtc"\} (\S+)$', metrics, re.M)
    assert found, "no duplex_sessions_active{transport=\"webrtc\"} in /metrics after a WebRTC call"
    return float(found.group(1))


def test_talk_to_the_agent_and_interrupt_it(server: str, browser: Browser) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page_errors: list[str] = []
    page.on("pageerror", lambda error: page_errors.append(str(error)))
    page.add_init_script(STATE_RECORDER)
    page.add_init_script(PEER_RECORDER)
    root = page.locator("html")

    page.goto(f"{server}/")
    set_raw_microphone(page)
    page.get_by_role("button", name="Connect").click()
    expect(root).to_have_attribute("data-connection", "connected", timeout=20_000)

    # Before the first answer the agent is silent: Opus DTX sends a packet every 400 ms, not 50 a
    # second (duplex/media/paced_track.py); the answer after it must still play (below).
    wait_for(page, AUDIO_PACKETS_RECEIVED, "the first audio packets at the page")
    before = page.evaluate(AUDIO_PACKETS_RECEIVED)
    page.wait_for_timeout(DTX_WINDOW_MS)  # a measuring window, not a wait for an event
    during = page.evaluate(AUDIO_PACKETS_RECEIVED) - before
    assert "speaking" not in page.evaluate("window.__duplexStates"), "the agent spoke in the window"
    assert during <= 5, f"{during} audio packets in {DTX_WINDOW_MS} ms of the agent's silence"
    wait_for(page, "() => +document.documentElement.dataset.localLevel > 0.001",
             "the fake microphone's level on the page")

    # The server hears the speech, ends the turn and answers with audio the page decodes.
    wait_for(page, "() => window.__duplexStates.includes('user_speaking')", "speech_started from the server")
    expect(page.locator('#transcript li[data-role="user"]').first).to_be_visible(timeout=TURN_TIMEOUT_MS)
    speaking_level = wait_for(
        page,
        "() => { const d = document.documentElement.dataset;"
        " return d.state === 'speaking' && +d.remoteLevel > 0.01 ? +d.remoteLevel : false; }",
        "agent audio on the page while it speaks")
    answer = page.locator('#transcript li[data-role="assistant"]').first
    expect(answer.locator(".text")).not_to_have_text(re.compile(r"^(…)?$"))
    expect(page.locator("#latency-last")).to_have_text(re.compile(r"^\d+ ms$"))

    # The next loop of speech lands on the answer: the barge-in shows, and the agent goes quiet.
    wait_for(page, "() => document.documentElement.dataset.state === 'interrupted'", "the barge-in")
    wait_for(
        page,
        "loud => { const d = document.documentElement.dataset;"
        " return d.state === 'interrupted' && +d.remoteLevel < Math.min(0.005, loud / 10); }",
        "agent audio going quiet during the barge-in", arg=speaking_level, timeout_ms=5_000)
    truncated = page.locator('#transcript li[data-role="assistant"][data-status="truncated"]')
    expect(truncated.first).to_be_visible(timeout=10_000)
    expect(truncated.first.locator(".meta")).to_contain_text("interrupted")
    screenshot(page, "web-client-e2e.png")

    states = page.evaluate("window.__duplexStates")
    for earlier, later in [("user_speaking", "thinking"), ("thinking", "speaking"), ("speaking", "interrupted")]:
        assert states.index(earlier) < states.index(later), states
    # The settings the page sent (session.update) were accepted: no error came back.
    expect(page.locator("#error")).to_be_hidden()

    page.get_by_role("button", name="Hang up").click()
    expect(root).to_have_attribute("data-connection", "closed")
    expect(root).not_to_have_attribute("data-state", re.compile(".+"))
    expect(root).to_have_attribute("data-remote-level", "0.0000")
    deadline = time.monotonic() + 10
    while sessions_active(server) > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sessions_active(server) == 0, "the server still holds the session after the hang-up"
    context.close()
    assert page_errors == [], page_errors
