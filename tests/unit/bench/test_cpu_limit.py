"""``bench.cpu_limit``: the CPU limit ``bench.proxy``'s limited throughput runs put each
router under, as Kubernetes puts a pod's ``limits.cpu`` (a CFS quota per 100 ms)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.cpu_limit import CpuLimit, CpuLimitUnavailable

# a parent and the child it forked, both spinning once the parent has said so
SPIN = "import os\nif os.fork():\n    print('forked', flush=True)\nwhile True: pass"


@pytest.fixture
def limit() -> Iterator[CpuLimit]:
    try:
        made = CpuLimit.create(0.1, name=f"kvroute-test-{time.monotonic_ns()}")
    except CpuLimitUnavailable as exc:
        pytest.skip(f"no cgroup can be made on this machine: {exc}")
    yield made
    made.close()


def _cgroup_of(pid: int) -> set[str]:
    return {line.split(":", 2)[2] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()}


def test_a_confined_process_tree_is_stalled_by_the_quota_and_released(limit: CpuLimit) -> None:
    spinner = subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE)
    assert spinner.stdout is not None
    try:
        assert spinner.stdout.readline() == b"forked\n"
        assert limit.label == "100m"
        assert limit.confine(spinner.pid) == 2  # the process and the child it forked
        inside = "/" + limit.path.name
        assert any(path.endswith(inside) for path in _cgroup_of(spinner.pid))
        deadline = time.monotonic() + 10  # two spinning processes use 0.1 cores in 5 ms
        while limit.throttled() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert limit.throttled() > 0
        assert limit.release(spinner.pid) == 2
        assert not any(path.endswith(inside) for path in _cgroup_of(spinner.pid))
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(spinner.pid)], check=False)
        spinner.kill()
        spinner.wait()
        spinner.stdout.close()
    limit.close()
    assert not limit.path.exists()


def test_a_limit_of_no_cores_is_refused() -> None:
    with pytest.raises(ValueError, match="above 0 cores"):
        CpuLimit.create(0)


def test_a_limit_below_the_smallest_quota_is_labelled_as_enforced() -> None:
    try:
        tiny = CpuLimit.create(0.0001, name=f"kvroute-test-{time.monotonic_ns()}")
    except CpuLimitUnavailable as exc:
        pytest.skip(f"no cgroup can be made on this machine: {exc}")
    try:
        assert tiny.label == "10m"  # 1 ms per 100 ms: the least the bench sets
    finally:
        tiny.close()
