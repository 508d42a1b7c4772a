"""A stage that hangs (its worker blocked in a step, or its socket reader stuck, without dying) is
found by the coordinator's periodic stats question it no longer answers (``hang_timeout_s``), and
handled as a crash: the request it holds fails with a clear error (long before the stream's idle
timeout), /healthz reports it, its process is killed and started again, and the pipeline serves.
"""

from __future__ import annotations

import pytest

from pipeline import runner
from pipeline.coordinator import PipelineError
from tests.pipeline import hung_stage
from tests.pipeline.helpers import collect, make_request, running, toy_config, turn
from tests.pipeline.test_reader_death import healthz, serving_again

# The stream's idle timeout stays at its 60 s: the request must fail by the hang's detection.
TOY = toy_config(hang_timeout_s=2.0, restart_delay_s=1.0)


@pytest.mark.parametrize("serve", [hung_stage.serve_with_a_worker_that_hangs,
                                   hung_stage.serve_with_a_reader_that_hangs],
                         ids=["worker", "reader"])
async def test_a_stage_that_hangs_is_found_reported_and_restarted(
    monkeypatch: pytest.MonkeyPatch, serve: object,
) -> None:
    monkeypatch.setattr(runner, "serve_stage_group", serve)
    async with running(TOY, "process") as coordinator:
        hung = coordinator.stage_pids[hung_stage.GROUP]
        with pytest.raises(PipelineError, match="hangs") as failure:
            await collect(coordinator, make_request(turn("hello there")), timeout=30)
        assert failure.value.stage == "thinker"
        health = await healthz(coordinator)
        assert health.status_code == 503 and health.json()["status"] == "error", health.text
        assert "thinker" in health.json()["error"] and "hangs" in health.json()["error"]
        await serving_again(coordinator)
        assert coordinator.stage_pids[hung_stage.GROUP] != hung
