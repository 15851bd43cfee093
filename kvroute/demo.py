"""``kvroute up --demo``: one shared-prefix chat workload, round-robin then the default (kv_cost).

Several groups of chat requests share long system prompts (the shared-prefix workload
of SGLang's and llm-d's benchmarks, scaled to a laptop), with more groups than one
replica's cache holds, so where each request goes decides whether its prompt is already
cached. The demo switches the ``default`` workload through the admin API, as an operator
would, empties the engines' caches between phases so both start cold, and sends the same
requests, shuffled the same way, through the proxy in each phase.

Every figure shown comes from outside the router: hit rates from the engines' own
``/metrics`` counters (and the ``cached_tokens`` they report in each response), time to
first token from this client's clock. The router's own prediction (the proxy's fidelity
counters) is shown beside the engines' figures, never in their place. A live table shows
per-replica requests in flight (the engines' running + waiting), hit rate and TTFT while
a phase runs (on a terminal; elsewhere, plain lines every two seconds); at the end a
side-by-side comparison is printed and the two TTFT distributions are plotted to a PNG.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

from dataplane.metrics import PREFIX
from sidecar.load_metrics import EngineLoad, parse_engine_load

PHASES = ("round_robin", "kv_cost")  # the default workload's strategy
_WORDS = (
    *("cache", "prefix", "token", "block", "replica", "router", "engine", "prompt"),
    *("batch", "decode", "prefill", "latency", "tenant", "request", "stream", "system"),
    *("answer", "question", "model", "weight", "layer", "vector", "memory"),
)


@dataclass(frozen=True)
class DemoWorkload:
    """Sized so the groups' prefixes exceed one replica's cache but fit the fleet."""

    groups: int = 16
    prompts_per_group: int = 16
    system_tokens: int = 2000  # about one built-in token per word
    question_tokens: int = 80
    max_tokens: int = 8
    concurrency: int = 8
    seed: int = 20261130

    def requests(self, model: str) -> list[dict[str, Any]]:
        return [body for _, body in self._shuffled(model)]

    def request_groups(self) -> list[int]:
        """The group of each request of :meth:`requests`, in the same order."""
        return [group for group, _ in self._shuffled("")]

    def _shuffled(self, model: str) -> list[tuple[int, dict[str, Any]]]:
        rng = random.Random(self.seed)
        pairs = []
        for group in range(self.groups):
            system = f"You are assistant number {group}. " + words(rng, self.system_tokens)
            for prompt in range(self.prompts_per_group):
                question = f"Question {prompt}: " + words(rng, self.question_tokens)
                body = {
                    "model": model,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": question},
                    ],
                    "max_tokens": self.max_tokens,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                pairs.append((group, body))
        rng.shuffle(pairs)
        return pairs


def words(rng: random.Random, count: int) -> str:
    """``count`` words of the demo's vocabulary (about one simulated-model token each)."""
    return " ".join(rng.choice(_WORDS) for _ in range(count))


@dataclass(frozen=True)
class Answer:
    """One answered request, as the client saw it (what a miss analysis needs)."""

    index: int  # position in the phase's request list
    sent_at: float  # this client's perf_counter when the request went out
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    replica: str  # x-kvroute-replica, or "?" when the router does not say
    prefix_blocks: str = ""  # x-kvroute-prefix-blocks: "predicted/prompt" blocks
    decision: str = ""  # x-kvroute-decision
    total_s: float = 0.0  # until the answer's end
    error: str = ""  # the error event that ended the stream after its first token, if any
    completion_tokens: int = 0  # the usage's, or the chunks that carried a token
    last_token_s: float = 0.0  # when the last token arrived, from the request's start

    @property
    def itl_s(self) -> float | None:
        """The mean gap between tokens after the first, by this clock (None: one token)."""
        if self.completion_tokens < 2:
            return None
        return (self.last_token_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass
class PhaseResult:
    strategy: str
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # reported by the engines in each response's usage
    errors: int = 0
    by_replica: dict[str, int] = field(default_factory=dict)
    engine_queries: int = 0  # the engines' own prefix-cache counters over the phase
    engine_hits: int = 0
    # the proxy's own counters over the phase: prompt tokens routed, cached tokens predicted
    router_prompt_tokens: float = 0.0
    router_predicted_tokens: float = 0.0
    wall_s: float = 0.0
    answers: list[Answer] = field(default_factory=list)

    @property
    def engine_hit_rate(self) -> float:
        return self.engine_hits / self.engine_queries if self.engine_queries else 0.0

    @property
    def predicted_hit_rate(self) -> float | None:
        """The share of prompt tokens the router expected cached (None: it did not say)."""
        if not self.router_prompt_tokens:
            return None
        return self.router_predicted_tokens / self.router_prompt_tokens

    def ttft(self, q: float) -> float:
        if not self.ttft_s:
            return float("nan")
        ordered = sorted(self.ttft_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def summary(self) -> dict[str, Any]:
        done = len(self.ttft_s)
        return {
            "strategy": self.strategy,
            "requests": done,
            "errors": self.errors,
            "engine_hit_rate": round(self.engine_hit_rate, 4),
            "reported_cached_share": round(self.cached_tokens / max(self.prompt_tokens, 1), 4),
            "router_predicted_share": _rounded(self.predicted_hit_rate),
            "ttft_p50_s": round(self.ttft(0.5), 4),
            "ttft_p90_s": round(self.ttft(0.9), 4),
            "ttft_mean_s": round(statistics.fmean(self.ttft_s), 4) if done else None,
            "requests_per_s": round(done / self.wall_s, 2) if self.wall_s else None,
            "by_replica": dict(sorted(self.by_replica.items())),
        }


class EngineWatch:
    """Reads every engine's own ``/metrics``: load and prefix-cache counters."""

    def __init__(self, session: aiohttp.ClientSession, engines: list[str]) -> None:
        self.session = session
        self.engines = engines
        self.latest: dict[str, EngineLoad] = {}

    async def scrape(self) -> dict[str, EngineLoad]:
        loads = await asyncio.gather(*(self._one(url) for url in self.engines))
        self.latest = dict(zip(self.engines, loads, strict=True))
        return self.latest

    async def _one(self, url: str) -> EngineLoad:
        async with self.session.get(f"{url}/metrics") as response:
            return parse_engine_load(await response.text())

    async def reset_caches(self) -> None:
        """Empty every engine's prefix cache (vLLM's and SGLang's admin routes)."""
        for url in self.engines:
            for path in ("/reset_prefix_cache", "/flush_cache"):
                async with self.session.post(f"{url}{path}") as response:
                    if response.status < 300:
                        break


async def router_belief(session: aiohttp.ClientSession, proxy: str) -> tuple[float, float]:
    """The proxy's own fidelity counters, summed over workloads and replicas: prompt
    tokens routed and the cached tokens it predicted for them."""
    async with session.get(f"{proxy}/metrics") as response:
        text = await response.text()
    sums = {_ROUTED: 0.0, _PREDICTED: 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
    return sums[_ROUTED], sums[_PREDICTED]


_ROUTED = PREFIX + "prompt_tokens_total"
_PREDICTED = PREFIX + "predicted_cached_tokens_total"


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


class AdminClient:
    """Switches the ``default`` workload's strategy, as an operator would."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, token: str) -> None:
        self.session = session
        self.base_url = base_url
        self.headers = {"authorization": f"Bearer {token}"}

    async def set_strategy(self, strategy: str) -> None:
        await self.put_workload("default", {"strategy": strategy})

    async def put_workload(self, name: str, policy: dict[str, Any]) -> None:
        url = f"{self.base_url}/v1/workloads/{name}"
        body = {"name": name, **policy}
        async with self.session.put(url, json=body, headers=self.headers) as response:
            if response.status >= 300:
                raise RuntimeError(
                    f"admin API refused the {name} workload {policy}: {response.status} "
                    f"{await response.text()}"
                )


async def send_one(
    session: aiohttp.ClientSession,
    proxy: str,
    body: dict[str, Any],
    result: PhaseResult,
    index: int = -1,
    headers: dict[str, str] | None = None,
) -> None:
    """One streamed chat request; TTFT is the first content chunk, by this clock."""
    started = time.perf_counter()
    first: float | None = None
    last, chunks = 0.0, 0
    usage: dict[str, Any] = {}
    error = ""
    url = f"{proxy}/v1/chat/completions"
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                result.errors += 1
                return
            answered = response.headers
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if _has_token(chunk):
                    last, chunks = time.perf_counter() - started, chunks + 1
                    first = last if first is None else first
                usage = chunk.get("usage") or usage
                error = _stream_error(chunk) or error
    except (aiohttp.ClientError, TimeoutError, ValueError):
        result.errors += 1
        return
    if first is None:
        result.errors += 1
        return
    details = usage.get("prompt_tokens_details") or {}
    answer = Answer(
        index,
        started,
        first,
        int(usage.get("prompt_tokens", 0)),
        int(details.get("cached_tokens") or 0),
        answered.get("x-kvroute-replica", "?"),
        answered.get("x-kvroute-prefix-blocks", ""),
        answered.get("x-kvroute-decision", ""),
        time.perf_counter() - started,
        error,
        int(usage.get("completion_tokens") or chunks),
        last,
    )
    result.answers.append(answer)
    result.ttft_s.append(first)
    result.by_replica[answer.replica] = result.by_replica.get(answer.replica, 0) + 1
    result.prompt_tokens += answer.prompt_tokens
    result.cached_tokens += answer.cached_tokens


def _stream_error(chunk: dict[str, Any]) -> str:
    """The message of an error event (a stream ended by an error after its status), or ''."""
    body = chunk.get("error")
    if not body:
        return ""
    return str(body.get("message") or body) if isinstance(body, dict) else str(body)


def _has_token(chunk: dict[str, Any]) -> bool:
    """Whether a streamed chunk carries generated text (not only the role or usage)."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or choice.get("text"):
            return True
    return False


def _replica_rows(watch: EngineWatch, baseline: dict[str, EngineLoad]) -> list[tuple[str, ...]]:
    """Each replica's name, requests in flight and engine hit rate over the phase."""
    rows: list[tuple[str, ...]] = []
    for index, url in enumerate(watch.engines):
        load = watch.latest.get(url, EngineLoad())
        before = baseline.get(url, EngineLoad())
        queries = load.prefix_cache_queries - before.prefix_cache_queries
        hits = load.prefix_cache_hits - before.prefix_cache_hits
        rate = f"{hits / queries:.0%}" if queries > 0 else "-"
        rows.append((f"r{index}", str(load.running + load.waiting), rate))
    return rows


def _ttft_caption(result: PhaseResult) -> str:
    done = len(result.ttft_s)
    if not done:
        return "waiting for the first responses"
    return (
        f"TTFT p50 {result.ttft(0.5) * 1e3:.0f} ms, p90 {result.ttft(0.9) * 1e3:.0f} ms "
        f"over {done} requests (client clock)"
    )


def _live_table(result: PhaseResult, watch: EngineWatch, baseline: dict[str, EngineLoad]) -> Table:
    table = Table(title=f"phase: {result.strategy}", expand=False)
    for column in ("replica", "in flight", "engine hit rate"):
        table.add_column(column, justify="right")
    for row in _replica_rows(watch, baseline):
        table.add_row(*row)
    table.caption = _ttft_caption(result)
    return table


class PhaseView:
    """A phase as it runs: a live table and progress bar on a terminal; elsewhere (a pipe,
    a log file, CI), where redrawing would leave every frame in the output, one plain line
    at most every ``PLAIN_EVERY_S`` seconds and one at the end."""

    PLAIN_EVERY_S = 2.0

    def __init__(self, console: Console, strategy: str, total: int) -> None:
        self.console = console
        self.total = total
        self.done = 0
        self.progress = Progress(
            TextColumn(f"[bold]{strategy:>12}"), BarColumn(), MofNCompleteColumn(), console=console
        )
        self._task = self.progress.add_task(strategy, total=total)
        self._live = Live(console=console, refresh_per_second=4) if console.is_terminal else None
        self._printed_at = -self.PLAIN_EVERY_S

    def __enter__(self) -> PhaseView:
        if self._live is not None:
            self._live.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)

    def advance(self) -> None:
        self.done += 1
        self.progress.advance(self._task)

    def show(
        self, result: PhaseResult, watch: EngineWatch, baseline: dict[str, EngineLoad], last: bool
    ) -> None:
        if self._live is not None:
            self._live.update(Group(_live_table(result, watch, baseline), self.progress))
            return
        now = time.monotonic()
        if not last and now - self._printed_at < self.PLAIN_EVERY_S:
            return
        self._printed_at = now
        replicas = "; ".join(
            f"{name} {flight} in flight, hit {rate}"
            for name, flight, rate in _replica_rows(watch, baseline)
        )
        line = f"{result.strategy:>12} {self.done}/{self.total} | {replicas} | "
        self.console.print(
            line + _ttft_caption(result), markup=False, highlight=False, soft_wrap=True
        )


async def run_phase(
    session: aiohttp.ClientSession,
    proxy: str | Callable[[int], str],
    bodies: list[dict[str, Any]],
    result: PhaseResult,
    concurrency: int,
    on_done: Callable[[], None],
) -> None:
    """Send ``bodies`` over ``concurrency`` clients; ``proxy`` is the router's URL, or
    gives each request's URL by its index (requests sent straight to engines)."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(len(bodies)):
        queue.put_nowait(index)

    async def worker() -> None:
        while not queue.empty():
            index = queue.get_nowait()
            url = proxy if isinstance(proxy, str) else proxy(index)
            await send_one(session, url, bodies[index], result, index)
            on_done()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def run_demo(
    proxy: str,
    admin_url: str,
    admin_token: str,
    engines: list[str],
    model: str,
    out_dir: Path,
    workload: DemoWorkload | None = None,
    console: Console | None = None,
) -> list[PhaseResult]:
    """Both phases, the comparison printed, the report and plot written to ``out_dir``."""
    workload = workload or DemoWorkload()
    console = console or Console()
    bodies = workload.requests(model)
    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=workload.concurrency * 2)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        watch = EngineWatch(session, engines)
        admin = AdminClient(session, admin_url, admin_token)
        results = []
        for strategy in PHASES:
            results.append(
                await _phase(session, proxy, admin, watch, strategy, bodies, workload, console)
            )
    console.print(comparison_table(results))
    await asyncio.to_thread(write_report, results, out_dir)
    console.print(f"report and TTFT plot written to {out_dir}")
    return results


async def _phase(
    session: aiohttp.ClientSession,
    proxy: str,
    admin: AdminClient,
    watch: EngineWatch,
    strategy: str,
    bodies: list[dict[str, Any]],
    workload: DemoWorkload,
    console: Console,
) -> PhaseResult:
    await admin.set_strategy(strategy)
    await watch.reset_caches()
    baseline = dict(await watch.scrape())
    routed, predicted = await router_belief(session, proxy)
    result = PhaseResult(strategy)
    started = time.perf_counter()
    with PhaseView(console, strategy, len(bodies)) as view:
        sending = asyncio.ensure_future(
            run_phase(session, proxy, bodies, result, workload.concurrency, view.advance)
        )
        while not sending.done():
            await watch.scrape()
            view.show(result, watch, baseline, last=False)
            await asyncio.wait({sending}, timeout=0.5)  # refresh the table twice a second
        await sending
        final = await watch.scrape()
        view.show(result, watch, baseline, last=True)
    result.wall_s = time.perf_counter() - started
    result.engine_queries = sum(
        final[u].prefix_cache_queries - baseline[u].prefix_cache_queries for u in watch.engines
    )
    result.engine_hits = sum(
        final[u].prefix_cache_hits - baseline[u].prefix_cache_hits for u in watch.engines
    )
    routed_after, predicted_after = await router_belief(session, proxy)
    result.router_prompt_tokens = routed_after - routed
    result.router_predicted_tokens = predicted_after - predicted
    return result


def comparison_table(results: list[PhaseResult]) -> Table:
    table = Table(title=f"{PHASES[0]} vs {PHASES[1]}: same requests, same fleet")
    table.add_column("figure")
    for result in results:
        table.add_column(result.strategy, justify="right")
    rows: list[tuple[str, Callable[[PhaseResult], str]]] = [
        ("engine prefix-cache hit rate (engines' counters)", lambda r: f"{r.engine_hit_rate:.1%}"),
        (
            "cached tokens reported in responses",
            lambda r: f"{r.cached_tokens / max(r.prompt_tokens, 1):.1%}",
        ),
        ("cached tokens predicted (the router's counters)", _predicted),
        ("TTFT p50 (client clock)", lambda r: f"{r.ttft(0.5) * 1e3:.0f} ms"),
        ("TTFT p90 (client clock)", lambda r: f"{r.ttft(0.9) * 1e3:.0f} ms"),
        ("requests completed / errors", lambda r: f"{len(r.ttft_s)} / {r.errors}"),
        ("throughput", lambda r: f"{len(r.ttft_s) / max(r.wall_s, 1e-9):.1f} req/s"),
    ]
    for label, render in rows:
        table.add_row(label, *(render(r) for r in results))
    return table


def _predicted(result: PhaseResult) -> str:
    rate = result.predicted_hit_rate
    return "-" if rate is None else f"{rate:.1%}"


def write_report(results: list[PhaseResult], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "demo.json").write_text(json.dumps([r.summary() for r in results], indent=2) + "\n")
    plot_ttft(results, out_dir / "ttft.png")


def plot_ttft(
    results: list[PhaseResult],
    path: Path,
    title: str = "kvroute demo: TTFT distribution per routing strategy",
) -> None:
    """One CDF per phase; past ten phases the colours repeat dashed, and the legend
    sits beside the plot so that it hides no curve."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    many = len(results) > 4
    figure, axes = plt.subplots(figsize=(11, 4.5) if many else (7, 4))
    for index, result in enumerate(results):
        ordered = sorted(result.ttft_s)
        if not ordered:
            continue
        share = [(i + 1) / len(ordered) for i in range(len(ordered))]
        style = "-" if index < 10 else "--"
        times = [t * 1e3 for t in ordered]
        axes.step(times, share, style, where="post", label=result.strategy)
    axes.set_xscale("log")
    axes.set_xlabel("time to first token (ms, client clock)")
    axes.set_ylabel("share of requests")
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    if many:
        axes.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    else:
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
