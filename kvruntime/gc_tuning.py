"""The garbage collector's thresholds every kvroute server runs with, and its benchmarks
run with to measure what the servers do.

Each server makes many short-lived objects per request or event, and the default
young-generation threshold (700 net allocations) makes collections a visible share of
its time: the proxy's objects per request, the control plane's decoded batches and key
lists at tens of thousands of events per second, the sidecar's key mapper with one small
object per cached block. At 50,000 the proxy runs 30,000 requests without a collection.
"""

from __future__ import annotations

import gc

SERVER_GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc() -> None:
    """Set :data:`SERVER_GC_THRESHOLDS` for this process."""
    gc.set_threshold(*SERVER_GC_THRESHOLDS)
