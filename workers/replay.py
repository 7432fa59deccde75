"""``python -m workers replay``: a captured workload, replayed at its recorded rate.

A **workload** (``WorkloadSpec``) is what the control plane keeps of a
window of real traffic (``controlplane/experiments``): the prompt-length and
output-length distributions as fine histograms that keep the long tail, the
arrival rate and its burstiness, and the share of prompt tokens the prefix
cache served. Never the users' text.

Design note. Replay turns a workload back into requests (``sample``), pure
and seeded:

* lengths are drawn from the histograms (a bucket by its count, then
  uniformly inside it; the buckets are a few percent wide, so the drawn
  distribution follows the captured one to within KS noise);
* arrivals are a gamma renewal process at the recorded rate whose gaps have
  the recorded coefficient of variation (1 is Poisson; above 1, bursts);
* prefix sharing: a share of the requests starts with a prefix common to
  all of them (a seeded "system prompt"), as long as makes the cached share
  of prompt tokens the recorded one; the rest of each prompt is its own;
* prompts are token ids of the served model's own tokenizer (ids of plain
  English words), so each prompt has exactly the drawn length.

The sampler is shared with the control plane, which drives experiment arms
with it; this command runs the same replay from the worker's side.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from workers.loadgen import WORDS, Client, PlannedRequest, format_summary, parse_slos, summarize
from workers.loadgen import replay as replay_planned

DEFAULT_BLOCK_SIZE = 16


# ---- histograms ---------------------------------------------------------------------


def fine_edges(max_value: int) -> list[int]:
    """Bucket edges from 1 past ``max_value``: one token wide up to 32, then
    about 4% wide (rounded up to whole tokens), so the long tail keeps its shape."""
    edges = list(range(1, 33))
    while edges[-1] <= max_value:
        edges.append(max(edges[-1] + 1, math.ceil(edges[-1] * 1.04)))
    return edges


@dataclass(frozen=True)
class Histogram:
    """Integer values in buckets ``[edges[i], edges[i+1])``."""

    edges: tuple[int, ...]
    counts: tuple[int, ...]

    @classmethod
    def of(cls, values: Sequence[int]) -> Histogram:
        values = [max(1, int(v)) for v in values]
        edges = fine_edges(max(values, default=1))
        counts = [0] * (len(edges) - 1)
        for v in values:
            counts[bisect.bisect_right(edges, v) - 1] += 1
        # Trim empty buckets at both ends; the edges stay contiguous.
        first = next((i for i, c in enumerate(counts) if c), 0)
        last = max((i for i, c in enumerate(counts) if c), default=0)
        return cls(tuple(edges[first : last + 2]), tuple(counts[first : last + 1]))

    @property
    def total(self) -> int:
        return sum(self.counts)

    def sample(self, rng: random.Random) -> int:
        i = rng.choices(range(len(self.counts)), weights=self.counts)[0]
        return rng.randrange(self.edges[i], self.edges[i + 1])

    def mean(self) -> float:
        if not self.total:
            return 0.0
        return sum(c * (self.edges[i] + self.edges[i + 1] - 1) / 2 for i, c in enumerate(self.counts)) / self.total

    def quantile(self, q: float) -> int:
        """The bucket's lower edge where the cumulative count reaches ``q``."""
        target, seen = q * self.total, 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= target and c:
                return self.edges[i]
        return self.edges[-1] - 1

    def to_dict(self) -> dict[str, list[int]]:
        return {"edges": list(self.edges), "counts": list(self.counts)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Histogram:
        return cls(tuple(int(e) for e in data["edges"]), tuple(int(c) for c in data["counts"]))


# ---- the workload ----------------------------------------------------------------------


@dataclass(frozen=True)
class Observed:
    """One finished request as the gateway logged it (lengths only)."""

    arrival_seconds: float  # since the window began
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class WorkloadSpec:
    prompt_tokens: Histogram
    output_tokens: Histogram
    rate_per_second: float
    burstiness: float  # coefficient of variation of the arrival gaps; 1: Poisson
    prefix_hit_share: float  # prompt tokens served from the prefix cache / prompt tokens
    prefix_request_share: float  # requests with any cached prompt tokens / requests
    num_requests: int
    duration_seconds: float

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["prompt_tokens"] = self.prompt_tokens.to_dict()
        data["output_tokens"] = self.output_tokens.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkloadSpec:
        return cls(
            prompt_tokens=Histogram.from_dict(data["prompt_tokens"]),
            output_tokens=Histogram.from_dict(data["output_tokens"]),
            rate_per_second=float(data["rate_per_second"]),
            burstiness=float(data["burstiness"]),
            prefix_hit_share=float(data["prefix_hit_share"]),
            prefix_request_share=float(data["prefix_request_share"]),
            num_requests=int(data["num_requests"]),
            duration_seconds=float(data["duration_seconds"]),
        )


def capture(observed: Sequence[Observed], duration_seconds: float) -> WorkloadSpec:
    """The workload of a window's finished requests. Raises ValueError when
    there are none."""
    if not observed:
        raise ValueError("no requests to capture")
    times = sorted(o.arrival_seconds for o in observed)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    cv = 1.0
    if len(gaps) >= 2 and (m := sum(gaps) / len(gaps)) > 0:
        cv = math.sqrt(sum((g - m) ** 2 for g in gaps) / (len(gaps) - 1)) / m
    prompt_total = sum(o.prompt_tokens for o in observed)
    cached_total = sum(min(o.cached_tokens, o.prompt_tokens) for o in observed)
    # Traffic that began inside the window is rated over the time since it
    # began: the idle minutes before it (a fleet just started, a window wider
    # than the log) are not the workload's rate.
    active = duration_seconds - times[0] if 0 <= times[0] < duration_seconds else duration_seconds
    return WorkloadSpec(
        prompt_tokens=Histogram.of([o.prompt_tokens for o in observed]),
        output_tokens=Histogram.of([o.output_tokens for o in observed]),
        rate_per_second=len(observed) / active if active > 0 else float(len(observed)),
        burstiness=cv,
        prefix_hit_share=cached_total / prompt_total if prompt_total else 0.0,
        prefix_request_share=sum(1 for o in observed if o.cached_tokens > 0) / len(observed),
        num_requests=len(observed),
        duration_seconds=duration_seconds,
    )


def from_plan(planned: Sequence[PlannedRequest], duration_seconds: float) -> WorkloadSpec:
    """The workload of a loadgen scenario's plan (one token a word). A chat
    turn resends its conversation's history, which the cache serves."""
    history: dict[int, int] = {}
    observed = []
    for req in planned:
        if req.endpoint == "chat":
            c = req.conversation or 0
            first_turn = c not in history
            cached = history.get(c, len(req.prompt.split()))
            prompt = cached + len(req.user_turn.split())
            history[c] = prompt + req.max_tokens
            observed.append(Observed(req.start_seconds, prompt, req.max_tokens, 0 if first_turn else cached))
        else:
            observed.append(
                Observed(req.start_seconds, req.target_prompt_tokens or len(req.prompt.split()), req.max_tokens)
            )
    return capture(observed, duration_seconds)


# ---- sampling ----------------------------------------------------------------------------


def arrivals(
    rng: random.Random,
    rate: float,
    cv: float,
    *,
    duration_seconds: float | None = None,
    num_requests: int | None = None,
) -> list[float]:
    """Gamma renewal arrivals: mean gap 1/rate, coefficient of variation ``cv``."""
    shape = 1.0 / max(cv, 0.05) ** 2
    scale = 1.0 / (max(rate, 1e-9) * shape)
    times: list[float] = []
    t = 0.0
    while True:
        t += rng.gammavariate(shape, scale)
        if duration_seconds is not None and t >= duration_seconds:
            return times
        times.append(t)
        if num_requests is not None and len(times) >= num_requests:
            return times


def sample(
    spec: WorkloadSpec,
    *,
    vocabulary: Sequence[int],
    seed: int = 0,
    duration_seconds: float | None = None,
    num_requests: int | None = None,
    rate_scale: float = 1.0,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_model_len: int | None = None,
) -> list[PlannedRequest]:
    """Seeded requests of the workload's lengths, rate and prefix sharing
    (see the design note); over ``duration_seconds`` or ``num_requests``."""
    if not vocabulary:
        raise ValueError("an empty vocabulary")
    if duration_seconds is None and num_requests is None:
        duration_seconds = spec.duration_seconds
    rng = random.Random(seed)
    times = arrivals(
        rng,
        spec.rate_per_second * rate_scale,
        spec.burstiness,
        duration_seconds=duration_seconds,
        num_requests=num_requests,
    )
    reuse_p = spec.prefix_request_share
    reuse_fraction = min(1.0, spec.prefix_hit_share / reuse_p) if reuse_p > 0 else 0.0
    longest = spec.prompt_tokens.edges[-1]
    shared = [rng.choice(vocabulary) for _ in range(longest)]
    planned: list[PlannedRequest] = []
    for t in times:
        output = spec.output_tokens.sample(rng)
        prompt = spec.prompt_tokens.sample(rng)
        if max_model_len is not None:
            output = min(output, max(1, max_model_len // 4))
            prompt = max(1, min(prompt, max_model_len - output))
        prefix = 0
        if reuse_fraction and rng.random() < reuse_p:
            # The engine computes at least a prompt's last token: a prefix
            # ends a whole block before it. Nearest block, so rounding does
            # not bias the share.
            ceiling = (prompt - 1) // block_size * block_size
            prefix = min(ceiling, round(reuse_fraction * prompt / block_size) * block_size)
        ids = shared[:prefix] + [rng.choice(vocabulary) for _ in range(prompt - prefix)]
        planned.append(PlannedRequest(t, "completions", output, prompt_token_ids=ids, target_prompt_tokens=prompt))
    return planned


def simulated_hit_share(planned: Sequence[PlannedRequest], block_size: int = DEFAULT_BLOCK_SIZE) -> float:
    """The share of prompt tokens an unbounded block-hash prefix cache would
    serve to ``planned`` in order: a prompt hits its leading whole blocks
    that an earlier prompt stored, short of its last token."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for req in planned:
        ids = req.prompt_token_ids or []
        total += len(ids)
        full = len(ids) // block_size
        cached = 0
        for b in range(full):
            key = tuple(ids[: (b + 1) * block_size])
            if key in seen and (b + 1) * block_size < len(ids):
                cached = (b + 1) * block_size
            elif key not in seen:
                break
        hit += cached
        seen.update(tuple(ids[: (b + 1) * block_size]) for b in range(full))
    return hit / total if total else 0.0


def vocabulary(model_dir: str | Path | None) -> list[int]:
    """Token ids of plain English words in the model's own tokenizer;
    without a checkpoint, stand-in ids (lengths stay exact, text is noise)."""
    if model_dir is None or not (Path(model_dir) / "tokenizer.json").is_file():
        return list(range(100, 356))
    # Imported here: only a replay against a known checkpoint needs it.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    ids = tok.encode(" ".join(WORDS), add_special_tokens=False).ids
    specials = {tok.token_to_id(t) for t in ("<s>", "</s>", "<unk>", "<pad>", "<|endoftext|>")}
    return sorted({i for i in ids if i not in specials})


# ---- the command ------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="a worker's OpenAI base URL (never the gateway's)")
    parser.add_argument(
        "--workload",
        required=True,
        type=Path,
        help="a workload JSON file (GET /api/v1/workloads/<id>/ 'spec', or this command's --save)",
    )
    parser.add_argument("--model-dir", help="the served checkpoint, for its tokenizer")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiply the recorded rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--goodput", nargs="+", metavar="NAME:MS", help="SLOs: ttft:MS tpot:MS (default ttft:1000 tpot:100)"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


async def run(
    url: str,
    spec: WorkloadSpec,
    *,
    duration_seconds: float,
    seed: int = 0,
    rate_scale: float = 1.0,
    model_dir: str | None = None,
    slos: dict[str, float] | None = None,
    wait_seconds: float = 300.0,
) -> dict[str, Any]:
    """Replay against one worker; loadgen's summary of what the client saw."""
    client = Client(url, model=None, api_key=None)
    try:
        # A worker whose engine is still loading names no context length (and
        # refuses requests): wait for it, as loadgen's --wait does.
        deadline = time.monotonic() + wait_seconds
        while True:
            try:
                client.model, max_model_len = await client.discover()
                if max_model_len is not None:
                    break
            except aiohttp.ClientError:
                if time.monotonic() >= deadline:
                    raise
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(1.0)
        planned = sample(
            spec,
            vocabulary=vocabulary(model_dir),
            seed=seed,
            duration_seconds=duration_seconds,
            rate_scale=rate_scale,
            max_model_len=max_model_len,
        )
        records, wall = await replay_planned(client, planned)
    finally:
        await client.close()
    summary = summarize(records, wall, slos or parse_slos(None))
    summary.update(num_planned=len(planned), rate=spec.rate_per_second * rate_scale)
    return summary


def main(args: argparse.Namespace) -> int:
    try:
        data = json.loads(args.workload.read_text())
        spec = WorkloadSpec.from_dict(data.get("spec", data))
        summary = asyncio.run(
            run(
                args.url,
                spec,
                duration_seconds=args.duration,
                seed=args.seed,
                rate_scale=args.rate_scale,
                model_dir=args.model_dir,
                slos=parse_slos(args.goodput),
            )
        )
    except (OSError, ValueError, KeyError, aiohttp.ClientError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1) if args.json else format_summary(summary, f"replay of {args.workload.name}"))
    return 0 if summary["successful_requests"] else 1
