"""The web client's camera against a server whose model sees (issue 24): Debian's Chromium with its
fake camera and its fake microphone looping espeak speech, talking to the tiny Qwen3-Omni preset
over real WebRTC in the loopback-only namespace.

The page finds that the model sees (/v1/models), offers video, shows its camera controls; "Show my
camera" sends the fake camera's picture, which the server keeps (``duplex_video_frames_total``),
and each spoken turn committed while it shows gets a thumbnail in the transcript. A screenshot goes
to test-artifacts/.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, expect, sync_playwright

from harness.server import ServerProcess, run_server, write_preset
from harness.speech import speech_wav
from tests.web.browser import launch_chromium, require_loopback_only, screenshot, set_raw_microphone

pytestmark = pytest.mark.e2e

TURN_TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_loopback_only()
    tmp = tmp_path_factory.mktemp("camera-page")
    preset = write_preset(tmp / "preset.yaml", base="qwen3_omni_tiny")
    with run_server(preset, tmp=tmp) as running:
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    require_loopback_only()
    wav = speech_wav("What do you see in front of me?", 48000, pad_before_s=0.5, pad_after_s=1.5)
    with sync_playwright() as playwright:
        browser = launch_chromium(playwright, wav)
        yield browser
        browser.close()


def test_the_page_shows_the_agent_its_camera(server: ServerProcess, browser: Browser) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page_errors: list[str] = []
    page.on("pageerror", lambda error: page_errors.append(str(error)))
    kept = server.metric("duplex_video_frames_total", {"outcome": "kept"})

    page.goto(f"{server.url}/")
    set_raw_microphone(page)
    page.get_by_role("button", name="Connect").click()
    expect(page.locator("html")).to_have_attribute("data-connection", "connected", timeout=20_000)
    camera = page.get_by_role("button", name="Show my camera")
    expect(camera).to_be_enabled()
    camera.click()
    expect(page.get_by_role("button", name="Stop my camera")).to_have_attribute("aria-pressed", "true")
    page.wait_for_function("() => document.getElementById('preview').videoWidth > 0", timeout=10_000)

    # The picture reaches the server, and a turn committed while it shows gets its thumbnail.
    page.wait_for_function(
        "() => document.querySelector('#transcript li[data-role=\"user\"] img.seen') !== null",
        timeout=TURN_TIMEOUT_MS)
    assert server.metric("duplex_video_frames_total", {"outcome": "kept"}) > kept
    screenshot(page, "web-client-camera.png")

    page.get_by_role("button", name="Stop my camera").click()
    expect(page.get_by_role("button", name="Show my camera")).to_have_attribute("aria-pressed", "false")
    expect(page.locator("#preview")).to_be_hidden()
    page.get_by_role("button", name="Hang up").click()
    context.close()
    assert page_errors == [], page_errors
