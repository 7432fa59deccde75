"""``python -m workers loadgen``: streaming OpenAI traffic, measured at the client.

Three scenarios, each an open-loop plan of requests (seeded; arrivals do not
wait for completions):

* ``long-tail`` — Poisson arrivals at ``--rate``; most prompts a few hundred
  tokens, one in ten of thousands; outputs of tens to hundreds of tokens.
  ``/v1/completions``.
* ``chat`` — Poisson arrivals of turns in ``--sticky-keys`` conversations
  (16 if not given); each turn sends the whole history plus a new user
  message, so prompts grow and share prefixes. ``/v1/chat/completions``.
* ``burst`` — every ``--burst-period`` seconds, ``rate × period`` short
  requests at once (the same mean rate as ``long-tail``, none of the
  smoothness). ``/v1/completions``.

Prompt lengths are in tokens of the served model: a calibration request
measures its tokens per word once (``usage.prompt_tokens``). Outputs run to
their planned length (``ignore_eos``, a vLLM extension both engines take).

Per request the client records, from its own clock: TTFT (send → first
content chunk), ITL (between content chunks), TPOT ((latency − TTFT) /
(output tokens − 1)), its largest gap between chunks (the stall figure;
"Metrics" in docs/architecture.md) and whether it failed before or after its first byte. The summary
follows ``vllm bench serve``: counts, throughput, mean/P50/P99 per figure,
and goodput at the SLOs of ``--goodput``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from workers.figures import mean, percentile

SESSION_HEADER = "x-chunkpilot-session"
SCENARIOS = ("long-tail", "chat", "burst")
DEFAULT_SLOS_MS = {"ttft": 1000.0, "tpot": 100.0}

# Prompt words: common English, so any BPE vocabulary splits them the same
# way every time. The calibration request turns words into tokens.
WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there would their we him been has when who will more no if out so said what up its about "
    "into than them can only other new some could time these two may then do first any my now such like our over "
    "man me even most made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still own see men work long "
    "get here between both life being under never day same another know while last might us great old year off "
    "come since against go came right used take three states himself few house use during without again place "
    "around however home small found thought went say part once general high upon school every does got united "
    "left number course war until always away something fact though water less public put think almost hand "
    "enough far took head yet government system better set told nothing night end why called didn find look "
    "asked later knew point next program city business give group toward young days let room president side "
    "social given present several order national possible rather second face per among form important often "
    "things looked early white case john become large big need four within felt along children saw best church "
    "ever least power development light thing seemed family interest want members mind country area others done"
).split()


@dataclass
class PlannedRequest:
    """One request of a scenario: when to send it and what."""

    start_seconds: float
    endpoint: str  # "completions" or "chat"
    max_tokens: int
    prompt: str = ""
    user_turn: str = ""  # chat: the new user message
    conversation: int | None = None  # chat: index of its conversation
    session_key: str | None = None
    target_prompt_tokens: int = 0
    # completions: token ids sent instead of ``prompt`` (replay's exact lengths)
    prompt_token_ids: list[int] | None = None


@dataclass
class RequestRecord:
    start_seconds: float  # since the run began
    endpoint: str
    session_key: str | None
    status: int = 0  # HTTP status; 0 when no response arrived
    success: bool = False
    error: str | None = None
    got_first_byte: bool = False  # any content reached the client
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the worker's prefix cache served (its usage says)
    output_tokens: int = 0
    ttft_seconds: float | None = None
    latency_seconds: float | None = None
    itl_seconds: list[float] = field(default_factory=list)
    max_gap_seconds: float | None = None
    tpot_seconds: float | None = None
    finish_reason: str | None = None
    target_prompt_tokens: int = 0

    @property
    def retryable(self) -> bool:
        """Failed cleanly: refused before any byte, with a status to retry on."""
        return not self.success and not self.got_first_byte and self.status in (429, 503)


# ---- scenarios ----------------------------------------------------------------


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, count)))


def _poisson_arrivals(rng: random.Random, rate: float, duration: float) -> list[float]:
    times: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return times
        times.append(t)


def _long_tail_prompt_tokens(rng: random.Random) -> int:
    if rng.random() < 0.1:
        return rng.randint(2000, 8000)
    return rng.randint(100, 600)


def plan(
    scenario: str,
    *,
    duration_seconds: float,
    rate: float,
    seed: int = 0,
    tokens_per_word: float = 1.0,
    max_model_len: int | None = None,
    sticky_keys: int | None = None,
    burst_period_seconds: float = 5.0,
) -> list[PlannedRequest]:
    """The seeded request plan of a scenario."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose one of {', '.join(SCENARIOS)}")
    rng = random.Random(seed)
    planned: list[PlannedRequest] = []

    def words_for(tokens: int) -> int:
        return max(1, int(tokens / tokens_per_word))

    def fit(prompt_tokens: int, max_tokens: int) -> int:
        if max_model_len is None:
            return prompt_tokens
        return max(8, min(prompt_tokens, int((max_model_len - max_tokens) * 0.9)))

    def key(index: int) -> str | None:
        return None if not sticky_keys else f"key-{index % sticky_keys}"

    if scenario == "long-tail":
        for t in _poisson_arrivals(rng, rate, duration_seconds):
            max_tokens = rng.randint(16, 256)
            tokens = fit(_long_tail_prompt_tokens(rng), max_tokens)
            planned.append(
                PlannedRequest(
                    t,
                    "completions",
                    max_tokens,
                    _words(rng, words_for(tokens)),
                    session_key=key(rng.randrange(1 << 30)) if sticky_keys else None,
                    target_prompt_tokens=tokens,
                )
            )
    elif scenario == "burst":
        per_burst = max(1, round(rate * burst_period_seconds))
        t = 0.0
        while t < duration_seconds:
            for _ in range(per_burst):
                max_tokens = rng.randint(32, 128)
                tokens = fit(rng.randint(100, 400), max_tokens)
                planned.append(
                    PlannedRequest(
                        t,
                        "completions",
                        max_tokens,
                        _words(rng, words_for(tokens)),
                        session_key=key(rng.randrange(1 << 30)) if sticky_keys else None,
                        target_prompt_tokens=tokens,
                    )
                )
            t += burst_period_seconds
    else:  # chat
        conversations = sticky_keys or 16
        system = _words(rng, words_for(120))
        for t in _poisson_arrivals(rng, rate, duration_seconds):
            c = rng.randrange(conversations)
            planned.append(
                PlannedRequest(
                    t,
                    "chat",
                    rng.randint(32, 128),
                    prompt=system,
                    user_turn=_words(rng, words_for(rng.randint(20, 80))),
                    conversation=c,
                    session_key=f"key-{c}" if sticky_keys else None,
                )
            )
    return planned


# ---- the client ------------------------------------------------------------------


async def _sse_events(response: aiohttp.ClientResponse) -> Any:
    """The JSON events of an SSE body, up to ``[DONE]``. Splits raw bytes
    itself: at thousands of events a second the client's own cost shows in
    what it measures."""
    buffer = b""
    async for data in response.content.iter_any():
        buffer += data
        while (end := buffer.find(b"\n\n")) >= 0:
            event, buffer = buffer[:end], buffer[end + 2 :]
            if not event.startswith(b"data: "):
                continue
            payload = event[6:]
            if payload == b"[DONE]":
                return
            yield json.loads(payload)


class Client:
    """Streams one planned request and times it.

    aiohttp, as ``vllm bench serve`` uses: its C HTTP parser costs the client
    about a quarter of the CPU per event that httpx's pure-Python one does,
    and on a small host the client shares the cores with the server it
    measures.
    """

    def __init__(
        self,
        url: str,
        *,
        model: str | None,
        api_key: str | None,
        ignore_eos: bool = True,
        timeout_seconds: float = 600.0,
    ):
        self.url = url.rstrip("/")
        self.model = model
        self.ignore_eos = ignore_eos
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = aiohttp.ClientSession(
            base_url=self.url,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_seconds, connect=10.0),
            connector=aiohttp.TCPConnector(limit=0),
        )
        self.histories: dict[int, list[dict[str, str]]] = {}

    async def close(self) -> None:
        await self.http.close()

    async def discover(self) -> tuple[str, int | None]:
        """The served model's name and context length (GET /v1/models)."""
        async with self.http.get("/v1/models") as r:
            r.raise_for_status()
            card = (await r.json())["data"][0]
        return self.model or card["id"], card.get("max_model_len")

    async def calibrate(self) -> float:
        """Tokens per word of ``WORDS`` for the served model's tokenizer."""
        text = _words(random.Random(12345), 400)
        body = {"prompt": text, "max_tokens": 1, "temperature": 0}
        if self.model:
            body["model"] = self.model
        async with self.http.post("/v1/completions", json=body) as r:
            r.raise_for_status()
            usage = (await r.json())["usage"]
        return max(0.05, usage["prompt_tokens"] / 400)

    def _body(self, req: PlannedRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "max_tokens": req.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.model:
            body["model"] = self.model
        if req.endpoint == "chat":
            history = self.histories.setdefault(req.conversation or 0, [{"role": "system", "content": req.prompt}])
            body["messages"] = [*history, {"role": "user", "content": req.user_turn}]
        elif req.prompt_token_ids is not None:
            body["prompt"] = req.prompt_token_ids
        else:
            body["prompt"] = req.prompt
        return body

    async def send(self, req: PlannedRequest, run_start: float) -> RequestRecord:
        path = "/v1/chat/completions" if req.endpoint == "chat" else "/v1/completions"
        record = RequestRecord(
            start_seconds=time.perf_counter() - run_start,
            endpoint=req.endpoint,
            session_key=req.session_key,
            target_prompt_tokens=req.target_prompt_tokens,
        )
        headers = {SESSION_HEADER: req.session_key} if req.session_key else {}
        body = self._body(req)
        text_parts: list[str] = []
        start = time.perf_counter()
        last = start
        try:
            async with self.http.post(path, json=body, headers=headers) as response:
                record.status = response.status
                if response.status != 200:
                    raw = await response.read()
                    record.error = raw.decode(errors="replace")[:300]
                    return record
                async for chunk in _sse_events(response):
                    now = time.perf_counter()
                    if "error" in chunk:
                        record.error = json.dumps(chunk["error"])[:300]
                        continue
                    if chunk.get("usage"):
                        record.prompt_tokens = chunk["usage"]["prompt_tokens"]
                        record.output_tokens = chunk["usage"]["completion_tokens"]
                        record.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get(
                            "cached_tokens"
                        ) or 0
                    for choice in chunk.get("choices", []):
                        text = choice.get("text")
                        if text is None:
                            text = (choice.get("delta") or {}).get("content")
                        if text:
                            if record.ttft_seconds is None:
                                record.ttft_seconds = now - start
                                record.got_first_byte = True
                            else:
                                record.itl_seconds.append(now - last)
                            last = now
                            text_parts.append(text)
                        if choice.get("finish_reason"):
                            record.finish_reason = choice["finish_reason"]
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"[:300]
            return record
        record.latency_seconds = time.perf_counter() - start
        record.success = record.error is None and record.finish_reason not in (None, "abort")
        if record.success and req.endpoint == "chat":
            history = self.histories[req.conversation or 0]
            history += [
                {"role": "user", "content": req.user_turn},
                {"role": "assistant", "content": "".join(text_parts)},
            ]
        if record.itl_seconds:
            record.max_gap_seconds = max(record.itl_seconds)
        if record.ttft_seconds is not None and record.output_tokens > 1:
            record.tpot_seconds = (record.latency_seconds - record.ttft_seconds) / (record.output_tokens - 1)
        return record


async def replay(
    client: Client, planned: list[PlannedRequest], *, max_concurrency: int | None = None, time_scale: float = 1.0
) -> tuple[list[RequestRecord], float]:
    """Send every planned request at its time (open loop); (records, wall seconds)."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    run_start = time.perf_counter()

    async def one(req: PlannedRequest) -> RequestRecord:
        delay = req.start_seconds * time_scale - (time.perf_counter() - run_start)
        if delay > 0:
            await asyncio.sleep(delay)
        if semaphore is None:
            return await client.send(req, run_start)
        async with semaphore:
            return await client.send(req, run_start)

    records = await asyncio.gather(*(one(r) for r in planned))
    return list(records), time.perf_counter() - run_start


# ---- the summary -----------------------------------------------------------------


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """``ttft:500 tpot:50 e2el:2000`` (milliseconds), as ``vllm bench serve --goodput``."""
    if not items:
        return dict(DEFAULT_SLOS_MS)
    slos: dict[str, float] = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"bad SLO {item!r}: use ttft:MS, tpot:MS or e2el:MS")
        slos[name] = float(value)
    return slos


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    ms = [v * 1000 for v in values]
    return {"mean": mean(ms), "p50": percentile(ms, 50), "p95": percentile(ms, 95), "p99": percentile(ms, 99)}


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    if not record.success:
        return False
    checks = {"ttft": record.ttft_seconds, "tpot": record.tpot_seconds, "e2el": record.latency_seconds}
    for name, limit_ms in slos.items():
        value = checks[name]
        if value is not None and value * 1000 > limit_ms:
            return False
        if value is None and name != "tpot":
            return False
    return True


FAILURE_REASONS = 3


def summarize(records: list[RequestRecord], duration_seconds: float, slos: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if meets_slos(r, slos)]
    status_counts: dict[str, int] = {}
    reasons: list[str] = []  # the first few distinct ones, so a failure says why
    for r in failed:
        status_counts[str(r.status)] = status_counts.get(str(r.status), 0) + 1
        reason = r.error or f"the stream ended with finish_reason {r.finish_reason}"
        if reason not in reasons and len(reasons) < FAILURE_REASONS:
            reasons.append(reason)
    return {
        "num_requests": len(records),
        "successful_requests": len(ok),
        "failed_requests": len(failed),
        "failed_before_first_byte": sum(1 for r in failed if not r.got_first_byte),
        "failed_after_first_byte": sum(1 for r in failed if r.got_first_byte),
        "failed_by_status": status_counts,
        "failure_reasons": reasons,
        "duration_seconds": duration_seconds,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_seconds if duration_seconds else 0.0,
        "output_throughput": output_tokens / duration_seconds if duration_seconds else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration_seconds if duration_seconds else 0.0,
        "slos_ms": slos,
        "goodput": len(good) / duration_seconds if duration_seconds else 0.0,
        "slo_attainment": len(good) / len(records) if records else 0.0,  # failed requests miss the SLOs
        "ttft_ms": _stats_ms([r.ttft_seconds for r in ok if r.ttft_seconds is not None]),
        "tpot_ms": _stats_ms([r.tpot_seconds for r in ok if r.tpot_seconds is not None]),
        "itl_ms": _stats_ms([g for r in ok for g in r.itl_seconds]),
        "max_gap_ms": _stats_ms([r.max_gap_seconds for r in ok if r.max_gap_seconds is not None]),
        "e2el_ms": _stats_ms([r.latency_seconds for r in ok if r.latency_seconds is not None]),
    }


def format_summary(s: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """The table ``vllm bench serve`` prints, plus stalls (max gap per request)."""
    lines = [f"{' ' + title + ' ':=^50}"]

    def row(label: str, value: Any, fmt: str = "{:<10}") -> None:
        lines.append(f"{label:<40}{fmt.format(value) if value is not None else 'n/a':<10}")

    row("Successful requests:", s["successful_requests"])
    row("Failed requests:", s["failed_requests"])
    if s["failed_requests"]:
        row("  before first byte / after:", f"{s['failed_before_first_byte']} / {s['failed_after_first_byte']}")
    row("Benchmark duration (s):", s["duration_seconds"], "{:<10.2f}")
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"], "{:<10.2f}")
    row("Request goodput (req/s):", s["goodput"], "{:<10.2f}")
    row("  at SLOs:", " ".join(f"{k}<={v:g}ms" for k, v in s["slos_ms"].items()), "{}")
    row("Output token throughput (tok/s):", s["output_throughput"], "{:<10.2f}")
    row("Total Token throughput (tok/s):", s["total_token_throughput"], "{:<10.2f}")
    for key, title_ in (
        ("ttft_ms", "Time to First Token"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)"),
        ("itl_ms", "Inter-token Latency"),
        ("max_gap_ms", "Stall: largest gap per request"),
        ("e2el_ms", "End-to-end Latency"),
    ):
        short = key.split("_")[0].upper() if key != "max_gap_ms" else "max gap"
        lines.append(f"{title_:-^50}")
        stats = s[key]
        row(f"Mean {short} (ms):", stats["mean"], "{:<10.2f}")
        row(f"Median {short} (ms):", stats["p50"], "{:<10.2f}")
        row(f"P95 {short} (ms):", stats["p95"], "{:<10.2f}")
        row(f"P99 {short} (ms):", stats["p99"], "{:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)


# ---- the command -------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="OpenAI-compatible base URL (worker or gateway)")
    parser.add_argument("--scenario", choices=SCENARIOS, default="long-tail")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    parser.add_argument("--rate", type=float, default=2.0, help="mean requests per second")
    parser.add_argument("--sticky-keys", type=int, help=f"send {SESSION_HEADER} with one of N keys")
    parser.add_argument("--api-key")
    parser.add_argument("--model", help="model name to send (default: the server's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--burst-period", type=float, default=5.0, help="burst: seconds between bursts")
    parser.add_argument("--max-concurrency", type=int)
    parser.add_argument(
        "--goodput", nargs="+", metavar="NAME:MS", help="SLOs: ttft:MS tpot:MS e2el:MS (default ttft:1000 tpot:100)"
    )
    parser.add_argument("--no-ignore-eos", action="store_true", help="let outputs stop at EOS (real models)")
    parser.add_argument("--json", action="store_true", help="print the summary and per-request records as JSON")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="replay this many plans of --duration, seed +1 each, a summary after each (0: forever)",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=0.0,
        help="seconds to wait for the server to serve its first request (e.g. workers still loading)",
    )


async def _connect(client: Client, wait_seconds: float) -> tuple[int | None, float]:
    """Discover and calibrate, retrying for up to ``wait_seconds`` while the
    server cannot serve yet (refused connections, 5xx, no model)."""
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            client.model, max_model_len = await client.discover()
            return max_model_len, await client.calibrate()
        except (aiohttp.ClientError, IndexError, KeyError) as exc:
            if time.monotonic() >= deadline:
                raise aiohttp.ClientError(f"{client.url} is not serving: {exc}") from exc
            await asyncio.sleep(1.0)


async def run(args: argparse.Namespace, on_round: Any = None) -> dict[str, Any]:
    """Replays ``args.rounds`` plans (0: until cancelled); returns the last
    round's result and hands each to ``on_round`` as it finishes."""
    slos = parse_slos(args.goodput)
    client = Client(args.url, model=args.model, api_key=args.api_key, ignore_eos=not args.no_ignore_eos)
    result: dict[str, Any] = {}
    try:
        max_model_len, tokens_per_word = await _connect(client, getattr(args, "wait", 0.0))
        rounds = getattr(args, "rounds", 1)
        index = 0
        while rounds == 0 or index < rounds:
            planned = plan(
                args.scenario,
                duration_seconds=args.duration,
                rate=args.rate,
                seed=args.seed + index,
                tokens_per_word=tokens_per_word,
                max_model_len=max_model_len,
                sticky_keys=args.sticky_keys,
                burst_period_seconds=args.burst_period,
            )
            records, wall = await replay(client, planned, max_concurrency=args.max_concurrency)
            summary = summarize(records, wall, slos)
            summary.update(
                scenario=args.scenario,
                rate=args.rate,
                url=args.url,
                model=client.model,
                tokens_per_word=tokens_per_word,
                round=index,
            )
            result = {"summary": summary, "requests": [asdict(r) for r in records]}
            if on_round is not None:
                on_round(result)
            index += 1
    finally:
        await client.close()
    return result


def main(args: argparse.Namespace) -> int:
    def report(result: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(result, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x))
        else:
            print(format_summary(result["summary"], f"{args.scenario} @ {args.rate:g} req/s"), flush=True)

    try:
        result = asyncio.run(run(args, on_round=report))
    except (aiohttp.ClientError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0 if result["summary"]["successful_requests"] else 1
