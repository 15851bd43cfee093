"""``kvroute up`` as a user runs it: a whole fleet of real processes, then SIGTERM.

Each test starts ``kvroute up`` with a marker in its environment, which every child
inherits; after the launcher exits, no process on the machine may still carry the
marker, and the run folder must be gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer

from kvroute.servers import free_port

pytestmark = pytest.mark.e2e

KVROUTE = str(Path(sys.executable).parent / "kvroute")
KVROUTE_SIM = str(Path(sys.executable).parent / "kvroute-sim")
UP_TIMEOUT_S = 120


@dataclass
class UpProcess:
    proc: subprocess.Popen[str]
    marker: str
    lines: list[str] = field(default_factory=list)

    def read_until(self, needle: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if needle in line:
                return line
        raise AssertionError(f"kvroute up ended before {needle!r}:\n" + "\n".join(self.lines))

    def value(self, pattern: str) -> str:
        for line in self.lines:
            match = re.search(pattern, line)
            if match:
                return match.group(1)
        raise AssertionError(f"no {pattern!r} in:\n" + "\n".join(self.lines))


def _marked_processes(marker: str) -> list[int]:
    needle = f"KVROUTE_TEST_MARKER={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


@contextmanager
def kvroute_up(*args: str) -> Iterator[UpProcess]:
    marker = uuid.uuid4().hex
    env = {**os.environ, "KVROUTE_TEST_MARKER": marker}
    proc = subprocess.Popen(
        [KVROUTE, "up", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    up = UpProcess(proc, marker)
    try:
        yield up
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in _marked_processes(marker):  # never leave a stray process behind
            os.kill(pid, signal.SIGKILL)
        if proc.stdout is not None:
            proc.stdout.close()


def _complete(proxy: str, prompt: str) -> dict[str, object]:
    import urllib.request

    body = json.dumps({"model": "kvroute/sim-model", "prompt": prompt, "max_tokens": 4})
    request = urllib.request.Request(
        f"{proxy}/v1/completions",
        data=body.encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        result: dict[str, object] = json.loads(response.read())
        return result


def _stop_and_check(up: UpProcess, run_dir: Path) -> None:
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=60) == 0, "\n".join(up.lines)
    assert _marked_processes(up.marker) == [], "processes outlived kvroute up"
    assert not run_dir.exists(), "the temporary run folder was left behind"


@pytest.mark.parametrize("ha", [False, True], ids=["single", "ha"])
def test_up_serves_completions_and_stops_cleanly(ha: bool) -> None:
    port = free_port()
    flags = ["--replicas", "2", "--proxies", "1", "--port", str(port), "--time-scale", "0"]
    with kvroute_up(*flags, *(["--ha"] if ha else [])) as up:
        up.read_until("kvroute is up")
        run_dir = Path(up.value(r"run folder (\S+?)\)"))
        assert run_dir.is_dir()
        proxy = f"http://127.0.0.1:{port}"
        for index in range(6):
            answer = _complete(proxy, f"hello number {index} from the kvroute up test")
            assert answer["choices"], answer
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="none", max_retries=0)
        chat = client.chat.completions.create(
            model="kvroute/sim-model",
            messages=[{"role": "user", "content": "Hello through kvroute up"}],
            max_tokens=4,
        )
        assert chat.choices[0].message.content
        stream = client.completions.create(
            model="kvroute/sim-model", prompt="a streamed hello", max_tokens=4, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        client.close()
        assert len(up.value(r"admin API\s+(.+)").split(",")) == (2 if ha else 1)
        if not ha:
            assert _run_banner_example(up, "With the official openai client")
            _check_the_printed_tokenizer_counts_as_the_engines(up, proxy)
        _stop_and_check(up, run_dir)


def _check_the_printed_tokenizer_counts_as_the_engines(up: UpProcess, proxy: str) -> None:
    """The tokenizer folder printed beside the model, loaded as a benchmark client loads
    it, counts a prompt's tokens as the engine's usage does."""
    folder = Path(up.value(r"model\s+kvroute/sim-model\s+tokenizer (\S+)"))
    client_side = Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompt = "Counting tokens the way guidellm does: Übergrößen, 日本語, and 12345 digits."
    usage = _complete(proxy, prompt)["usage"]
    assert isinstance(usage, dict)
    assert usage["prompt_tokens"] == len(client_side.encode(prompt).ids)


def _run_banner_example(up: UpProcess, heading: str) -> str:
    """Run the shell command the banner shows under ``heading`` as pasted into a shell
    outside the virtualenv (no venv on PATH); its output."""
    up.read_until("Ctrl-C stops everything")
    start = next(i for i, line in enumerate(up.lines) if line.startswith(heading))
    end = up.lines.index("", start)
    command = "\n".join(up.lines[start + 1 : end])
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/")}
    done = subprocess.run(
        ["sh", "-c", command], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0, (command, done.stderr)
    return done.stdout.strip()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["term", "hup"])
def test_a_fleet_whose_output_reader_has_gone_still_stops_whole(sig: signal.Signals) -> None:
    """``kvroute up | tee log`` with tee gone, or a closed terminal (SIGHUP): the fleet
    stops whole. A failed write of "stopping" used to skip the shutdown and leave every
    child running; SIGHUP ended the launcher alone."""
    with kvroute_up("--replicas", "1", "--port", str(free_port()), "--time-scale", "0") as up:
        up.read_until("kvroute is up")
        run_dir = Path(up.value(r"run folder (\S+?)\)"))
        assert len(_marked_processes(up.marker)) > 1  # the launcher and its children
        assert up.proc.stdout is not None
        up.proc.stdout.close()  # the reader goes away
        up.proc.send_signal(sig)
        assert up.proc.wait(timeout=60) == 0
        assert _marked_processes(up.marker) == [], "processes outlived kvroute up"
        assert not run_dir.exists(), "the temporary run folder was left behind"


def test_up_against_running_engines() -> None:
    sim_argv = [KVROUTE_SIM, "--port", "0", "--kv-events-endpoint", "tcp://127.0.0.1:0"]
    sim_argv += ["--replay-endpoint", "tcp://127.0.0.1:0", "--instant"]
    sims = [
        subprocess.Popen(sim_argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    try:
        urls = []
        for sim in sims:
            assert sim.stdout is not None
            line = sim.stdout.readline()
            urls.append(re.search(r"http=(\S+)", line).group(1))  # type: ignore[union-attr]
        port = free_port()
        with kvroute_up("--engines", ",".join(urls), "--port", str(port)) as up:
            up.read_until("kvroute is up")
            run_dir = Path(up.value(r"run folder (\S+?)\)"))
            assert up.value(r"engines\s+(.+)") == ", ".join(urls)
            answer = _complete(
                f"http://127.0.0.1:{port}", "hello to an engine kvroute did not start"
            )
            assert answer["choices"], answer
            _stop_and_check(up, run_dir)
        for sim in sims:
            assert sim.poll() is None, "kvroute up stopped an engine it did not start"
    finally:
        for sim in sims:
            sim.terminate()
            sim.wait(timeout=10)
            if sim.stdout is not None:
                sim.stdout.close()


def test_port_in_use_is_one_line_and_exit_2() -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [KVROUTE, "up", "--port", str(port)], capture_output=True, text=True, timeout=60
        )
    assert result.returncode == 2
    assert f"port {port}" in result.stderr and "--port" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_engine_that_does_not_answer_is_one_line_and_exit_2() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    result = subprocess.run(
        [KVROUTE, "up", "--engines", dead, "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"engine {dead} does not answer" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize(
    ("flag", "complaint"),
    [(["--replicas", "0"], "must be at least 1"), (["--engines", "nope"], "expected http")],
)
def test_bad_flag_is_one_line_and_exit_2(flag: list[str], complaint: str) -> None:
    result = subprocess.run([KVROUTE, "up", *flag], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert complaint in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("event_format", ["vllm", "sglang"])
def test_up_pd_runs_a_disaggregated_fleet(event_format: str) -> None:
    """``--pd 1:1``: a prefill and a decode sim, their roles announced, requests served
    by both halves (the prefill's blocks read by the decode sim, whole and streamed)."""
    port = free_port()
    flags = ["--pd", "1:1", "--port", str(port), "--time-scale", "0"]
    with kvroute_up(*flags, "--event-format", event_format) as up:
        up.read_until("kvroute is up")
        run_dir = Path(up.value(r"run folder (\S+?)\)"))
        prefill = up.value(r"P/D\s+prefill (\S+)")
        proxy = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{proxy}/readyz", timeout=10) as response:
            assert json.loads(response.read())["roles"] == {"prefill": 1, "decode": 1}
        assert _complete(proxy, "hello through a disaggregated fleet")["choices"]
        client = openai.OpenAI(base_url=f"{proxy}/v1", api_key="none", max_retries=0)
        stream = client.completions.create(
            model="kvroute/sim-model", prompt="a streamed hello", max_tokens=4, stream=True
        )
        assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        client.close()
        prompts = (
            "vllm:prompt_tokens_total" if event_format == "vllm" else "sglang:prompt_tokens_total"
        )
        with urllib.request.urlopen(f"{prefill}/metrics", timeout=10) as response:
            text = response.read().decode()
        counted = [line for line in text.splitlines() if line.startswith(prompts)]
        assert counted and float(counted[0].rsplit(" ", 1)[1]) > 0  # the prefill sim computed
        _stop_and_check(up, run_dir)
