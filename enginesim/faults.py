"""Faults on demand, so that the sidecar's and router's failure handling can be tested.

``POST /sim/faults`` (loopback clients only) takes a JSON object with any of these
fields; the answer, and ``GET /sim/faults``, is the fault state after applying it.
``DELETE /sim/faults`` clears every lasting fault.

- ``pause_events`` (bool): true: batches still get a seq and enter the replay buffer but
  are not sent live (subscribers see a gap and can replay it); false: live again.
- ``restart`` (bool): an engine restart: running and waiting requests fail (HTTP 500 or
  an error event in the stream), the cache is emptied silently, the event seq restarts
  at 0, the replay buffer is dropped and the Prometheus counters start again at zero.
- ``drop_replay`` (bool): empty the replay buffer.
- ``slowdown`` (float >= 1): multiply every step's modelled duration.
- ``delay_ms`` (float >= 0): add this much wall time to every step (also with
  ``--instant``).
- ``hold_steps`` (bool): true: the engine takes no further step (requests are accepted
  and queue, as behind a prefill that does not end; its HTTP API and metrics still
  answer); false: it steps again. Unlike ``delay_ms`` the hold lasts until released, so a
  test can look at a request while it waits, however slow the machine.
- ``fail_requests`` (int >= 0): the next N inference requests get HTTP 500.
- ``error_rate`` (float in [0, 1]): that fraction of inference requests get HTTP 500
  (seeded, so reproducible).
- ``crash`` (bool): the process exits with status 70 right after answering.

``restart``, ``drop_replay`` and ``crash`` are actions; the others last until changed.
"""

from __future__ import annotations

import random
from typing import Annotated

import msgspec

CRASH_EXIT_CODE = 70


class FaultUpdate(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pause_events: bool | None = None
    restart: bool = False
    drop_replay: bool = False
    slowdown: Annotated[float, msgspec.Meta(ge=1.0)] | None = None
    delay_ms: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    hold_steps: bool | None = None
    fail_requests: Annotated[int, msgspec.Meta(ge=0)] | None = None
    error_rate: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    crash: bool = False


class FaultState(msgspec.Struct):
    events_paused: bool = False
    slowdown: float = 1.0
    delay_ms: float = 0.0
    steps_held: bool = False
    fail_requests: int = 0
    error_rate: float = 0.0
    restarts: int = 0

    def apply(self, update: FaultUpdate) -> None:
        if update.pause_events is not None:
            self.events_paused = update.pause_events
        if update.slowdown is not None:
            self.slowdown = update.slowdown
        if update.delay_ms is not None:
            self.delay_ms = update.delay_ms
        if update.hold_steps is not None:
            self.steps_held = update.hold_steps
        if update.fail_requests is not None:
            self.fail_requests = update.fail_requests
        if update.error_rate is not None:
            self.error_rate = update.error_rate
        if update.restart:
            self.restarts += 1


class FaultInjector:
    """Decides, per inference request, whether an injected 500 is due."""

    def __init__(self, seed: int = 0) -> None:
        self.state = FaultState()
        self._random = random.Random(seed)

    def should_fail(self) -> bool:
        if self.state.fail_requests > 0:
            self.state.fail_requests -= 1
            return True
        return self.state.error_rate > 0 and self._random.random() < self.state.error_rate

    def clear(self) -> FaultUpdate:
        """Reset every lasting fault; returns the update that does it."""
        return FaultUpdate(
            pause_events=False,
            slowdown=1.0,
            delay_ms=0.0,
            hold_steps=False,
            fail_requests=0,
            error_rate=0.0,
        )
