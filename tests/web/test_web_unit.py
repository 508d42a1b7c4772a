"""Runs the web client's Node unit tests (tests/web/*.test.mjs) so `make test` covers the page logic.

They test web_client/state.js, protocol.js and meter.js with Node's built-in runner; no browser,
no sockets.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).parent


def test_node_unit_tests_pass() -> None:
    node = shutil.which("node")
    assert node, "the web client's unit tests need node (apt package nodejs)"
    files = sorted(HERE.glob("*.test.mjs"))
    assert files, f"no *.test.mjs in {HERE}"
    result = subprocess.run(
        [node, "--test", "--test-reporter=tap", *map(str, files)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    assert re.search(r"^# pass [1-9]\d*$", result.stdout, re.M), report
    assert re.search(r"^# fail 0$", result.stdout, re.M), report
