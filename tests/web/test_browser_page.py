"""The web client in a real Chromium, with no duplex server: Playwright routes answer the static files
and POST /v1/realtime/calls, so what the page tells the user on every failure, the offer it sends,
its keyboard order and how it draws a conversation are checked without the model pipeline.
Requests never leave the browser; ICE gathering still needs the loopback-only namespace.
"""

from __future__ import annotations

import json
import mimetypes
import re
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest
from playwright.sync_api import Browser, Page, Route, expect, sync_playwright

from harness.speech import speech_wav
from tests.web.browser import WEB_CLIENT, launch_chromium, require_loopback_only, screenshot

pytestmark = pytest.mark.e2e

# A secure-context origin (getUserMedia needs one) on the discard port: should a route ever miss,
# the request goes nowhere.
ORIGIN = "http://127.0.0.1:9"
CALLS = "**/v1/realtime/calls"


def serve_web_client(route: Route) -> None:
    """Answers GET / and the client's static files from web_client/, as the server does."""
    path = urlparse(route.request.url).path
    file = (WEB_CLIENT / ("index.html" if path == "/" else path.lstrip("/"))).resolve()
    if WEB_CLIENT not in file.parents or not file.is_file():
        route.fulfill(status=404, body="not found")
        return
    content_type = mimetypes.guess_type(file.name)[0] or "application/octet-stream"
    route.fulfill(status=200, body=file.read_bytes(), content_type=content_type)


def error_body(message: str) -> str:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}})


@pytest.fixture(scope="module")
def playwright_session() -> Iterator:
    require_loopback_only()
    with sync_playwright() as playwright:
        yield playwright


@pytest.fixture(scope="module")
def browser(playwright_session) -> Iterator[Browser]:
    browser = launch_chromium(playwright_session, speech_wav("Hello, can you hear me?"))
    yield browser
    browser.close()


def open_page(browser: Browser, origin: str = ORIGIN, **context_options) -> tuple[Page, list[str]]:
    context = browser.new_context(**context_options)
    page = context.new_page()
    page_errors: list[str] = []
    page.on("pageerror", lambda error: page_errors.append(str(error)))
    page.route(f"{origin}/**", serve_web_client)
    page.goto(f"{origin}/")
    return page, page_errors


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    page, page_errors = open_page(browser)
    yield page
    page.context.close()
    assert page_errors == [], page_errors


def expect_failure(page: Page, *fragments: str) -> None:
    """The call failed with an alert naming every fragment, and the page is ready to retry."""
    alert = page.get_by_role("alert")
    expect(alert).to_be_visible()
    for fragment in fragments:
        expect(alert).to_contain_text(fragment)
    expect(page.locator("html")).to_have_attribute("data-connection", "failed")
    expect(page.locator("html")).not_to_have_attribute("data-state", "listening")
    expect(page.locator("#connect")).to_be_enabled()
    expect(page.locator("#hangup")).to_be_disabled()
    # The microphone was released: its meter hook reads silence again.
    expect(page.locator("html")).to_have_attribute("data-local-level", "0.0000")


def test_session_refused_503_shows_the_servers_message_after_a_proper_offer(page: Page) -> None:
    offers: list[dict] = []

    def refuse(route: Route) -> None:
        request = route.request
        offers.append({"method": request.method, "type": request.headers.get("content-type"),
                       "auth": request.headers.get("authorization"), "sdp": request.post_data or ""})
        route.fulfill(status=503, headers={"Retry-After": "3"}, content_type="application/json",
                      body=error_body("maximum number of sessions (8) reached"))

    page.route(CALLS, refuse)
    page.get_by_role("button", name="Connect").click()
    expect_failure(page, "no free session", "HTTP 503", "maximum number of sessions (8) reached", "in 3 s")
    assert len(offers) == 1
    offer = offers[0]
    assert (offer["method"], offer["type"], offer["auth"]) == ("POST", "application/sdp", None)
    assert offer["sdp"].startswith("v=0")
    assert "m=audio" in offer["sdp"] and "m=application" in offer["sdp"], offer["sdp"]
    # Candidates ride in the offer: the HTTP exchange has no way to trickle them later.
    assert "a=candidate" in offer["sdp"], offer["sdp"]


def test_api_key_goes_as_bearer_and_a_401_says_so(page: Page) -> None:
    seen: list[str | None] = []

    def unauthorized(route: Route) -> None:
        seen.append(route.request.headers.get("authorization"))
        route.fulfill(status=401, content_type="application/json", body=error_body("Incorrect API key provided"))

    page.route(CALLS, unauthorized)
    page.locator("details.settings summary").click()
    page.get_by_label("API key").fill("sk-wrong")
    page.get_by_role("button", name="Connect").click()
    expect_failure(page, "refused the API key", "HTTP 401", "Incorrect API key provided")
    assert seen == ["Bearer sk-wrong"]


def test_server_unreachable(page: Page) -> None:
    page.route(CALLS, lambda route: route.abort("connectionrefused"))
    page.get_by_role("button", name="Connect").click()
    expect_failure(page, "Cannot reach the server", ORIGIN)


def test_unusable_sdp_answer(page: Page) -> None:
    page.route(CALLS, lambda route: route.fulfill(
        status=201, content_type="application/sdp", headers={"Location": "/v1/realtime/calls/rtc_1"},
        body="this is not SDP"))
    page.get_by_role("button", name="Connect").click()
    expect_failure(page, "SDP")


def test_insecure_origin_explains_the_microphone_needs_https(browser: Browser) -> None:
    page, page_errors = open_page(browser, origin="http://duplex.invalid")
    page.get_by_role("button", name="Connect").click()
    expect_failure(page, "https")
    page.context.close()
    assert page_errors == []


def test_microphone_permission_denied(playwright_session) -> None:
    browser = launch_chromium(playwright_session, speech_wav("Hello, can you hear me?"), allow_microphone=False)
    try:
        page, page_errors = open_page(browser)
        page.get_by_role("button", name="Connect").click()
        expect_failure(page, "Microphone permission was denied")
        assert page_errors == []
    finally:
        browser.close()


def test_invalid_settings_stop_the_call_before_it_starts(page: Page) -> None:
    posts: list[str] = []
    page.route(CALLS, lambda route: posts.append(route.request.method) or route.abort())
    page.locator("details.settings summary").click()
    page.get_by_label("Speech threshold").fill("2")
    page.get_by_role("button", name="Connect").click()
    expect(page.locator("#vad-threshold:invalid")).to_have_count(1)
    page.get_by_role("button", name="Apply settings").click()
    expect(page.locator("#settings-note")).to_have_text("")
    page.get_by_label("Speech threshold").fill("0.6")
    page.get_by_role("button", name="Apply settings").click()
    expect(page.locator("#settings-note")).to_contain_text("when the call starts")
    expect(page.locator("html")).to_have_attribute("data-connection", "idle")
    assert posts == []


def test_keyboard_order_follows_the_page(page: Page) -> None:
    order = []
    for _ in range(4):
        page.keyboard.press("Tab")
        order.append(page.evaluate("document.activeElement.id || document.activeElement.tagName"))
    # Hang up is disabled before a call, so focus skips it; the transcript scrolls by keyboard too.
    assert order == ["connect", "mic", "SUMMARY", "transcript"], order
    page.keyboard.press("Shift+Tab")
    assert page.evaluate("document.activeElement.tagName") == "SUMMARY"
    page.keyboard.press("Enter")
    expect(page.locator("details.settings")).to_have_attribute("open", "")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "instructions"


def dispatch(page: Page, *events: dict) -> str | None:
    """Feeds events to the page as if the server had sent them; returns the root's data-state."""
    return page.evaluate(
        "events => { events.forEach(e => window.duplexClient.dispatch(e));"
        " return document.documentElement.dataset.state ?? null; }",
        list(events),
    )


def assistant(item_id: str, transcript: str = "") -> dict:
    return {"type": "message", "role": "assistant", "id": item_id,
            "content": [{"type": "output_audio", "transcript": transcript}]}


def user(item_id: str) -> dict:
    return {"type": "message", "role": "user", "id": item_id, "content": [{"type": "input_audio", "transcript": None}]}


def test_a_conversation_draws_states_transcript_truncation_and_latency(page: Page) -> None:
    root = page.locator("html")
    assert dispatch(page, {"type": "client.connecting"}, {"type": "client.channel_open"}) == "listening"
    assert dispatch(page, {"type": "input_audio_buffer.speech_started", "item_id": "u1"}) == "user_speaking"
    assert dispatch(page, {"type": "input_audio_buffer.speech_stopped", "item_id": "u1"},
                    {"type": "conversation.item.added", "item": user("u1")},
                    {"type": "conversation.item.input_audio_transcription.completed", "item_id": "u1",
                     "transcript": "What is the weather like?"},
                    {"type": "response.created", "response": {"id": "r1"}},
                    {"type": "response.output_item.added", "response_id": "r1", "item": assistant("a1")}) == "thinking"
    answer = "It is sunny and warm today, with a light breeze from the west all afternoon."
    for word in answer.split(" "):
        dispatch(page, {"type": "response.output_audio_transcript.delta", "response_id": "r1", "item_id": "a1",
                        "delta": word if word == answer.split(" ")[0] else f" {word}"})
    agent_entry = page.locator('#transcript li[data-role="assistant"]')
    expect(agent_entry).to_contain_text(answer)
    assert dispatch(page, {"type": "output_audio_buffer.started", "response_id": "r1"}) == "speaking"
    expect(page.locator("#latency-last")).to_have_text(re.compile(r"^\d+ ms$"))
    expect(page.locator("#latency-count")).to_have_text("1 turn")
    expect(agent_entry.locator(".meta")).to_contain_text("voice-to-voice")

    # The user talks over the answer: confirmed barge-in, in CONTRACT.md's order.
    assert dispatch(page, {"type": "input_audio_buffer.speech_started", "item_id": "u2"},
                    {"type": "output_audio_buffer.cleared", "response_id": "r1"},
                    {"type": "response.done", "response": {"id": "r1", "status": "cancelled"}},
                    {"type": "conversation.item.truncated", "item_id": "a1", "content_index": 0,
                     "audio_end_ms": 1500}) == "interrupted"
    expect(agent_entry).to_have_attribute("data-status", "truncated")
    unheard = agent_entry.locator("s.unheard")
    expect(unheard).to_have_count(1)
    heard_text = agent_entry.locator(".text").inner_text().removesuffix(unheard.inner_text()).rstrip()
    assert heard_text and answer.startswith(heard_text) and len(heard_text) < len(answer), heard_text
    assert answer == f"{heard_text} {unheard.inner_text()}", "the strike covers whole words"
    expect(agent_entry.locator(".meta")).to_contain_text("not heard")
    expect(page.locator('#transcript li[data-role="user"] .text')).to_have_text(["What is the weather like?"])
    screenshot(page, "web-client-desktop.png")
    page.set_viewport_size({"width": 390, "height": 844})
    screenshot(page, "web-client-phone.png")
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), "sideways scroll on a phone"

    assert dispatch(page, {"type": "input_audio_buffer.speech_stopped", "item_id": "u2"}) == "thinking"
    dispatch(page, {"type": "client.hangup"})
    expect(root).not_to_have_attribute("data-state", "thinking")
    expect(root).to_have_attribute("data-connection", "closed")
    expect(page.locator("#transcript li")).to_have_count(2)  # the transcript stays after hanging up


def test_the_servers_ice_servers_reach_the_peer_connection(browser: Browser) -> None:
    """A server with --ice-server offers its TURN relay (GET /v1/realtime/ice_servers); the page
    gives it, credentials and all, to its RTCPeerConnection. Without the endpoint (every other
    test here: a 404) the page uses none."""
    page, page_errors = open_page(browser)
    page.add_init_script("""
        const Native = window.RTCPeerConnection;
        window.__iceConfigs = [];
        window.RTCPeerConnection = function (config) {
          window.__iceConfigs.push(JSON.parse(JSON.stringify(config.iceServers)));
          return new Native(config);
        };
        window.RTCPeerConnection.prototype = Native.prototype;
    """)
    page.reload()
    offered = [{"urls": ["turn:127.0.0.1:9?transport=udp"], "username": "caller", "credential": "s3cret"}]
    asked: list[str | None] = []

    def ice_servers(route: Route) -> None:
        asked.append(route.request.headers.get("authorization"))
        route.fulfill(status=200, content_type="application/json", body=json.dumps({"ice_servers": offered}))

    page.route("**/v1/realtime/ice_servers", ice_servers)
    page.route(CALLS, lambda route: route.fulfill(status=503, content_type="application/json",
                                                  body=error_body("busy")))
    page.locator("details.settings summary").click()
    page.get_by_label("API key").fill("sk-test")
    page.get_by_role("button", name="Connect").click()
    expect_failure(page, "HTTP 503")
    assert asked == ["Bearer sk-test"]
    assert page.evaluate("window.__iceConfigs") == [offered]
    page.context.close()
    assert page_errors == [], page_errors


@pytest.mark.parametrize("sees", [True, False])
def test_a_call_offers_video_only_to_a_model_that_sees(page: Page, sees: bool) -> None:
    """The page asks /v1/models whether the model takes images: if it does, the offer carries a
    send-only video section (the camera or screen, attached later) and the video controls show;
    if not (every other test here: /v1/models answers 404), neither."""
    modalities = ["text", "audio", "image"] if sees else ["text", "audio"]
    page.route("**/v1/models", lambda route: route.fulfill(
        status=200, content_type="application/json",
        body=json.dumps({"object": "list", "data": [{"id": "m", "object": "model",
                                                      "input_modalities": modalities}]})))
    offers: list[str] = []

    def refuse(route: Route) -> None:
        offers.append(route.request.post_data or "")
        route.fulfill(status=503, content_type="application/json", body=error_body("busy"))

    page.route(CALLS, refuse)
    page.get_by_role("button", name="Connect").click()
    expect_failure(page, "HTTP 503")
    (offer,) = offers
    video = [section for section in offer.split("m=")[1:] if section.startswith("video")]
    if sees:
        assert len(video) == 1 and "a=sendonly" in video[0], offer
        expect(page.locator("#video-controls")).to_be_visible()
    else:
        assert video == [], offer
        expect(page.locator("#video-controls")).to_be_hidden()
    # No call: nothing to show the agent.
    expect(page.locator("#camera")).to_be_disabled()
