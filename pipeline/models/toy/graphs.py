"""Pipeline configs built from the toy runners, for tests and benchmarks of the framework itself.

``relay_chain`` is a straight line of pass-through stages (trivial compute): what it costs to run a
request through it is the framework's own overhead per hop.
"""

from __future__ import annotations

from typing import Any

from pipeline.config import PipelineConfig, parse_pipeline_config


def relay_chain(stages: int = 5, processes: int | None = None, **pipeline: Any) -> PipelineConfig:
    """``r0 -> r1 -> ... -> r{stages-1}`` (terminal), stage ``i`` in process group ``i % processes``.

    ``processes`` defaults to one process per stage, so that in process mode every hop crosses
    processes; ``pipeline`` sets top-level fields (``max_in_flight``, ...).
    """
    groups = processes or stages
    names = [f"r{i}" for i in range(stages)]
    return parse_pipeline_config(
        {
            "model": "toy",
            "entry": names[0],
            **pipeline,
            "stages": [
                {
                    "name": name,
                    "runner": "relay",
                    "scheduler": "simple",
                    "next": names[i + 1 : i + 2],
                    "terminal": i == stages - 1,
                    "process": f"p{i % groups}",
                }
                for i, name in enumerate(names)
            ],
        }
    )
