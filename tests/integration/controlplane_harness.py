"""Harness for the control plane's integration tests: a sidecar double on real NATS, and
real ``kvroute-controlplane`` and ``kvroute-sidecar`` processes.

:class:`SidecarDouble` publishes what a sidecar publishes (announce, load, event batches
with contiguous seqs) for a set of keys it holds, and answers resync requests with a
snapshot, exactly per the sidecar's stream semantics. It can also lose a batch on
purpose, to show the control plane recovers.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import trustme
from nats.aio.client import Client
from nats.aio.msg import Msg

from kvcore import subjects
from kvcore.pb import events_pb2
from kvruntime.nats import subscriptions_live

SNAPSHOT_PART_KEYS = 1000


@dataclass
class SidecarDouble:
    nats_url: str
    replica: str
    pool: str = "default"
    epoch: int = field(default_factory=lambda: time.time_ns() // 1000)
    held: set[int] = field(default_factory=set)
    seq: int = 0
    resyncs: int = 0
    nc: Client | None = None
    connect_options: dict[str, Any] = field(default_factory=dict)  # TLS, credentials

    async def start(self) -> SidecarDouble:
        self.nc = await nats.connect(self.nats_url, **self.connect_options)
        await self.nc.subscribe(
            subjects.resync_subject(self.pool, self.replica), cb=self._on_resync
        )
        assert await subscriptions_live(self.nc, timeout_s=30)
        return self

    async def stop(self) -> None:
        if self.nc is not None:
            await self.nc.close()

    def announcement(self) -> events_pb2.ReplicaAnnounce:
        return events_pb2.ReplicaAnnounce(
            replica_id=self.replica,
            pool=self.pool,
            base_url=f"http://127.0.0.1:9/{self.replica}",
            model="m",
            served_names=["m"],
            engine_kind=events_pb2.ENGINE_KIND_VLLM,
            block_size=16,
            sidecar_epoch=self.epoch,
            ts=time.time(),
        )

    async def announce(self) -> None:
        await self._publish(subjects.announce_subject(self.pool), self.announcement())

    async def load(self, running: int = 1) -> None:
        report = events_pb2.LoadReport(
            replica_id=self.replica,
            pool=self.pool,
            epoch=self.epoch,
            running=running,
            kv_usage=0.5,
            engine_up=True,
            ts=time.time(),
        )
        await self._publish(subjects.load_subject(self.pool, self.replica), report)

    async def store(self, keys: Iterable[int], *, lose: bool = False) -> None:
        keys = list(keys)
        self.held.update(keys)
        await self._events(lambda b: b.events.add().stored.keys.extend(keys), lose=lose)

    async def remove(self, keys: Iterable[int], *, lose: bool = False) -> None:
        keys = list(keys)
        self.held.difference_update(keys)
        await self._events(lambda b: b.events.add().removed.keys.extend(keys), lose=lose)

    async def _events(
        self, fill: Callable[[events_pb2.KvEventBatch], object], *, lose: bool
    ) -> None:
        batch = self._batch()
        fill(batch)
        if not lose:
            await self._publish(subjects.events_subject(self.pool, self.replica), batch)

    def _batch(self, **flags: object) -> events_pb2.KvEventBatch:
        batch = events_pb2.KvEventBatch(
            replica_id=self.replica,
            pool=self.pool,
            epoch=self.epoch,
            seq=self.seq,
            ts=time.time(),
            **flags,  # type: ignore[arg-type]
        )
        self.seq += 1
        return batch

    async def _on_resync(self, msg: Msg) -> None:
        request = events_pb2.ResyncRequest.FromString(msg.data)
        self.resyncs += 1
        reply = events_pb2.ResyncReply(accepted=True, epoch=self.epoch, first_seq=self.seq)
        await msg.respond(reply.SerializeToString())
        await self.snapshot(request.snapshot_id)

    async def snapshot(self, snapshot_id: int = 0) -> None:
        keys = sorted(self.held)
        parts = [keys[i : i + SNAPSHOT_PART_KEYS] for i in range(0, len(keys), SNAPSHOT_PART_KEYS)]
        parts = parts or [[]]
        for i, part in enumerate(parts):
            batch = self._batch(
                snapshot=True, snapshot_done=i == len(parts) - 1, snapshot_id=snapshot_id
            )
            batch.events.add().stored.keys.extend(part)
            await self._publish(subjects.events_subject(self.pool, self.replica), batch)

    async def _publish(self, subject: str, msg: object) -> None:
        assert self.nc is not None
        await self.nc.publish(subject, msg.SerializeToString())  # type: ignore[attr-defined]

    async def flush(self) -> None:
        assert self.nc is not None
        await self.nc.flush()


CONTROLPLANE_BIN = Path(sys.executable).parent / "kvroute-controlplane"
SIDECAR_BIN = Path(sys.executable).parent / "kvroute-sidecar"


@dataclass
class ControlPlaneProcess:
    """A real ``kvroute-controlplane`` process; ready once it prints its ready line."""

    args: list[str]
    grpc: str = ""
    admin: str = ""
    proc: asyncio.subprocess.Process | None = None
    workdir: str = ""

    async def start(self) -> ControlPlaneProcess:
        # its records (the default SQLite file) go to a folder of its own, not the checkout
        self.workdir = self.workdir or tempfile.mkdtemp(prefix="kvroute-test-cp-")
        self.proc = await asyncio.create_subprocess_exec(
            str(CONTROLPLANE_BIN),
            "--admin-port",
            "0",
            "--grpc-port",
            "0",
            *self.args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            cwd=self.workdir,
        )
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(60):  # a bound on a failure: imports take seconds
                line = (await self.proc.stdout.readline()).decode()
        except BaseException:  # not ready in time, or the test gave up: leave nothing behind
            self.proc.kill()
            await self.proc.wait()
            raise
        if not line.startswith("kvroute-controlplane ready"):
            raise RuntimeError(f"kvroute-controlplane did not start: {line!r}")
        fields = dict(part.split("=", 1) for part in line.split()[2:])
        self.grpc, self.admin = fields["grpc"], fields["admin"]
        return self

    def kill(self) -> None:
        """kill -9: no goodbye, the lease must expire."""
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        if self.proc is not None:
            await asyncio.wait_for(self.proc.wait(), 15)
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class SidecarProcess:
    """A real ``kvroute-sidecar`` process beside a ``kvroute-sim``."""

    args: list[str]
    proc: asyncio.subprocess.Process | None = None

    async def start(self) -> SidecarProcess:
        self.proc = await asyncio.create_subprocess_exec(
            str(SIDECAR_BIN),
            "--port",
            "0",
            *self.args,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        return self

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(self.proc.wait(), 15)


def server_certificate(directory: Path, *names: str) -> tuple[trustme.CA, Path, Path]:
    """A test CA and a certificate it signed for ``names``, written as PEM files:
    ``(ca, cert_path, key_path)``."""
    ca = trustme.CA()
    issued = ca.issue_cert(*names)
    cert, key = directory / "cert.pem", directory / "key.pem"
    issued.cert_chain_pems[0].write_to_path(str(cert))
    issued.private_key_pem.write_to_path(str(key))
    return ca, cert, key
