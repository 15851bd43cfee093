"""A CPU limit as Kubernetes sets one (``resources.limits.cpu``), for a router under test;
and CPUs kept from idling (:class:`Wakefulness`, ``bench.proxy --awake``).

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
import signal
import subprocess
import sys
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
        quota = max(1000, round(cores * PERIOD_US))
        if_v1 = {"cpu.cfs_period_us": str(PERIOD_US), "cpu.cfs_quota_us": str(quota)}
        path, home = _make(name, if_v1, {"cpu.max": f"{quota} {PERIOD_US}"})
        return cls(path, home, quota / PERIOD_US)  # the cores as enforced

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


class IdleGroup:
    """A cgroup whose processes run only when no other task wants their CPU
    (``cpu.idle``): any task that wakes up there preempts them at once, whatever its
    own group. (A ``SCHED_IDLE`` task alone is preempted at once only by tasks of its
    own task group; with autogroups on, each session, such as each process the
    supervisor starts, is a group of its own, and between groups the scheduler lets the
    running one finish its slice, about 3 ms.)"""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, name: str = "") -> IdleGroup:
        idle = {"cpu.idle": "1"}  # the same file in v1 and v2
        path, _ = _make(name or f"kvroute-bench-idle-{os.getpid()}", idle, idle)
        return cls(path)

    def confine(self, pid: int) -> int:
        return _move(pid, self.path)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()


def _make(name: str, v1: dict[str, str], v2: dict[str, str]) -> tuple[Path, Path]:
    """A new cgroup under this process's own CPU cgroup, with the files ``v1`` or ``v2``
    (by the hierarchy's version) written; its path and the home cgroup's."""
    hierarchy = _hierarchy()
    path = hierarchy.home / (name or f"kvroute-bench-{os.getpid()}")
    try:
        path.mkdir(exist_ok=True)
        control = hierarchy.home / "cgroup.subtree_control"
        # on v2 the controller must be on for the home cgroup's children
        if hierarchy.version == 2 and "cpu" not in control.read_text().split():
            control.write_text("+cpu")
        for file, value in (v1 if hierarchy.version == 1 else v2).items():
            (path / file).write_text(value)
    except OSError as exc:
        with contextlib.suppress(OSError):
            path.rmdir()
        raise CpuLimitUnavailable(f"cannot make the cgroup {path}: {exc}") from None
    return path, hierarchy.home


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


# a busy loop that runs only when nothing else would (SCHED_IDLE), for at most the given
# seconds; says when it runs
_SPIN = (
    "import os, sys, time\n"
    "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
    "end = time.monotonic() + float(sys.argv[1])\n"
    "print('spinning', flush=True)\n"
    "while time.monotonic() < end:\n"
    "    pass\n"
)


class Wakefulness:
    """Busy loops in an :class:`IdleGroup` (and under ``SCHED_IDLE``), one pinned to
    each of some CPUs, stopped (``SIGSTOP``) unless :meth:`keep_awake` was called last:
    while they run, those CPUs never idle, and any router waking up there preempts its
    loop at once (a nice-19 loop would not: continued after a stop, it kept the CPU for
    its whole slice, about 3 ms). On a virtual machine whose idle CPUs halt without
    polling first (:func:`idle_facts`), every wake-up of an idle CPU goes through the
    host's scheduler; with the loops running it does not. Each loop ends by itself
    after ``at_most_s`` seconds, whatever happens to the benchmark. Raises
    :class:`CpuLimitUnavailable` where no cgroup can be made."""

    def __init__(self, cpus: frozenset[int], *, at_most_s: float) -> None:
        self.spinners: list[subprocess.Popen[bytes]] = []
        self.awake = False
        self.group = IdleGroup.create()  # CpuLimitUnavailable: no cgroup here
        try:
            for cpu in sorted(cpus):
                spinner = subprocess.Popen(
                    [sys.executable, "-c", _SPIN, str(at_most_s)], stdout=subprocess.PIPE
                )
                self.spinners.append(spinner)
                os.sched_setaffinity(spinner.pid, {cpu})
                self.group.confine(spinner.pid)
                assert spinner.stdout is not None
                if not spinner.stdout.readline().startswith(b"spinning"):
                    raise RuntimeError(f"the busy loop for CPU {cpu} did not start")
            self.awake = True  # (they run: stop them)
            self.let_idle()
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [spinner.pid for spinner in self.spinners]

    def keep_awake(self) -> None:
        """The loops run (returns once each has been continued)."""
        self._signal(signal.SIGCONT, os.WCONTINUED, awake=True)

    def let_idle(self) -> None:
        """The loops stop (returns once each has stopped)."""
        self._signal(signal.SIGSTOP, os.WUNTRACED, awake=False)

    def _signal(self, sig: int, until: int, *, awake: bool) -> None:
        if self.awake == awake:
            return
        for spinner in self.spinners:
            if spinner.returncode is not None:
                continue  # it ended by itself (``at_most_s``)
            os.kill(spinner.pid, sig)
            _, status = os.waitpid(spinner.pid, until)  # stopped or continued, or ended
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                spinner.returncode = os.waitstatus_to_exitcode(status)  # (reaped here)
        self.awake = awake

    def close(self) -> None:
        for spinner in self.spinners:
            spinner.kill()
            spinner.wait()
            assert spinner.stdout is not None
            spinner.stdout.close()
        self.group.close()

    def __enter__(self) -> Wakefulness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def idle_facts() -> str:
    """How this machine's CPUs idle: the cpuidle driver and, for a KVM guest's
    ``haltpoll`` driver, how long an idle CPU polls before halting (0: it halts at once,
    and every wake-up goes through the host)."""
    root = Path("/sys/devices/system/cpu/cpuidle")
    try:
        driver = (root / "current_driver").read_text().strip()
    except OSError:
        return "cpuidle: unknown"
    poll = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
    with contextlib.suppress(OSError):
        driver += f", guest_halt_poll_ns={poll.read_text().strip()}"
    return f"cpuidle: {driver}"
