"""Debian's Chromium driven by Playwright, as TESTING.md ("A real browser") says, for the web tests.

`launch_chromium` starts one headless browser with a fake microphone playing a WAV; the caller owns
it (a module-scoped fixture) and closes it. Never `playwright install`: /usr/bin/chromium it is.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, Playwright

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]
WEB_CLIENT = ROOT / "web_client"
ARTIFACTS = ROOT / "test-artifacts"

# The page's microphone processing switches; a test that checks audio content turns them off, as
# Chromium's default processing reshapes the fake input.
PROCESSING_SWITCHES = ("echoCancellation", "noiseSuppression", "autoGainControl")


def require_loopback_only() -> None:
    """Skips unless the only network interface is lo: ICE gathers every interface it sees."""
    interfaces = {name for _, name in socket.if_nameindex()}
    if interfaces != {"lo"}:
        pytest.skip(
            f"needs a loopback-only network namespace (found {sorted(interfaces)}): run it through "
            "`make test`, or `unshare --net -- bash -c 'ip link set lo up && python -m pytest tests/web'`"
        )


def launch_chromium(playwright: Playwright, microphone_wav: Path, allow_microphone: bool = True) -> Browser:
    """Headless Chromium whose microphone plays `microphone_wav` (16-bit PCM, looping)."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium")
    args = [
        "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={microphone_wav}",
        "--autoplay-policy=no-user-gesture-required",
        "--allow-loopback-in-peer-connection",
    ]
    # The fake UI grants the permission prompt; without it, --deny-permission-prompts refuses it.
    args.append("--use-fake-ui-for-media-stream" if allow_microphone else "--deny-permission-prompts")
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)


def set_raw_microphone(page: Page) -> None:
    """Unticks the page's microphone processing settings (they apply when the microphone opens)."""
    page.locator("details.settings summary").click()
    for name in PROCESSING_SWITCHES:
        page.locator(f"input[name={name}]").uncheck()


def screenshot(page: Page, name: str) -> Path:
    """Saves a full-page screenshot as a test artifact (test-artifacts/ is gitignored)."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    return path
