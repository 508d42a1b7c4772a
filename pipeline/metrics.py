"""The pipeline's Prometheus metrics (names from CONTRACT.md), on the default registry.

Stages in other processes report through StageStats; the coordinator sets these in the serving
process, so /metrics shows every stage wherever it runs.
"""

from prometheus_client import Gauge, Histogram

_FAST_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

PIPELINE_REQUESTS_ACTIVE = Gauge("pipeline_requests_active", "Requests in flight in the pipeline")
PIPELINE_STAGE_LIVE_REQUESTS = Gauge(
    "pipeline_stage_live_requests", "Requests holding per-request state in a stage", ["stage"]
)
PIPELINE_STAGE_SECONDS = Histogram(
    "pipeline_stage_seconds", "Duration of one compute step of a stage", ["stage"],
    buckets=_FAST_BUCKETS,
)
PIPELINE_STAGE_QUEUE_DEPTH = Gauge(
    "pipeline_stage_queue_depth", "Inputs waiting for compute in a stage", ["stage"]
)
PIPELINE_ABORT_CLEAR_SECONDS = Histogram(
    "pipeline_abort_clear_seconds", "Abort sent until every stage acknowledged", buckets=_FAST_BUCKETS
)
PIPELINE_SHM_BYTES = Gauge("pipeline_shm_bytes", "Shared memory held for tensors in transit")
PIPELINE_CONVERSATION_STATE_BYTES = Gauge(
    "pipeline_conversation_state_bytes",
    "Bytes of per-conversation state a stage keeps between requests (KV caches)",
    ["stage"],
)
PIPELINE_CONVERSATIONS_KEPT = Gauge(
    "pipeline_conversations_kept", "Conversations whose state a stage keeps between requests", ["stage"]
)
