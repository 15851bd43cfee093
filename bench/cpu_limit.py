"""A CPU limit as Kubernetes sets one (``resources.limits.cpu``), for a router under test.

Kubernetes enforces a pod's CPU limit with a CFS quota: ``limits.cpu: 400m`` lets the
pod's processes run 40 ms of every 100 ms period, then stalls them until the next one.
:class:`CpuLimit` makes such a cgroup (cgroup v1's ``cpu`` controller, else cgroup v2's)
and moves a process tree into it and back out. ``bench.proxy`` uses it so that the
router, not the replicas and load generator on the other CPU, bounds a throughput run.

Making a cgroup needs write access to the hierarchy (root, or a delegated subtree); when
that is missing :meth:`CpuLimit.create` raises :class:`CpuLimitUnavailable` with the
reason, which the benchmark reports instead of a figure.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from bench.proxy_routers import descendants

PERIOD_US = 100_000  # Kubernetes' CFS period


class CpuLimitUnavailable(Exception):
    """No cgroup with a CPU controller can be made here (the message says why)."""


@dataclass(frozen=True)
class _Hierarchy:
    version: int  # 1 or 2
    home: Path  # the cgroup this process is in (where released processes go back to)


class CpuLimit:
    """A cgroup whose processes together get ``cores`` of CPU time (``0.4``: 400m)."""

    def __init__(self, path: Path, home: Path, cores: float) -> None:
        self.path, self.home, self.cores = path, home, cores

    @classmethod
    def create(cls, cores: float, name: str = "") -> CpuLimit:
        if not cores > 0:  # NaN too
            raise ValueError(f"a CPU limit must be above 0 cores, not {cores}")
        hierarchy = _hierarchy()
        path = hierarchy.home / (name or f"kvroute-bench-{os.getpid()}")
        quota = max(1000, round(cores * PERIOD_US))
        try:
            path.mkdir(exist_ok=True)
            if hierarchy.version == 1:
                (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (path / "cpu.cfs_quota_us").write_text(str(quota))
            else:  # the controller must be on for the home cgroup's children
                if "cpu" not in (hierarchy.home / "cgroup.subtree_control").read_text().split():
                    (hierarchy.home / "cgroup.subtree_control").write_text("+cpu")
                (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        except OSError as exc:
            with contextlib.suppress(OSError):
                path.rmdir()
            raise CpuLimitUnavailable(f"cannot make the cgroup {path}: {exc}") from None
        return cls(path, hierarchy.home, quota / PERIOD_US)  # the cores as enforced

    @property
    def label(self) -> str:
        """As a pod spec writes it: ``400m``."""
        return f"{round(self.cores * 1000)}m"

    def confine(self, pid: int) -> int:
        """Move ``pid`` and every process below it into the limit; processes moved."""
        return _move(pid, self.path)

    def release(self, pid: int) -> int:
        """Move ``pid`` and its descendants back to this process's own cgroup."""
        return _move(pid, self.home)

    def throttled(self) -> int:
        """Periods in which the limit stalled its processes so far (``cpu.stat``)."""
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "nr_throttled":
                return int(value)
        return 0

    def close(self) -> None:
        """Remove the cgroup (its processes must have left or ended)."""
        with contextlib.suppress(OSError):
            self.path.rmdir()


def _move(pid: int, cgroup: Path) -> int:
    moved = 0
    for process in descendants(pid):
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            (cgroup / "cgroup.procs").write_text(str(process))
            moved += 1
    return moved


def _hierarchy() -> _Hierarchy:
    """Where this process's CPU cgroup is: the v1 ``cpu`` controller's mount if there is
    one, else the v2 mount, if its ``cpu`` controller is available."""
    own = _own_cgroups()
    v1_mount = v2_mount = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        mount_point = Path(fields[4])
        fstype, super_options = fields[-3], fields[-1].split(",")
        if fstype == "cgroup" and "cpu" in super_options:
            v1_mount = v1_mount or mount_point
        elif fstype == "cgroup2":
            v2_mount = v2_mount or mount_point
    if v1_mount is not None and "cpu" in own:
        return _Hierarchy(1, v1_mount / own["cpu"].lstrip("/"))
    if v2_mount is not None and "" in own:
        home = v2_mount / own[""].lstrip("/")
        controllers = (home / "cgroup.controllers").read_text().split()
        if "cpu" not in controllers:
            raise CpuLimitUnavailable(f"cgroup v2 at {home} has no cpu controller")
        return _Hierarchy(2, home)
    raise CpuLimitUnavailable("no cgroup hierarchy with a cpu controller is mounted")


def _own_cgroups() -> dict[str, str]:
    """Controller -> this process's cgroup path (``""``: the v2 hierarchy)."""
    own: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            own[controller] = path
    return own
