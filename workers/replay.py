"""``python -m workers replay``: a captured workload, replayed at its recorded rate.

A **workload** (``WorkloadSpec``) is what the control plane keeps of a
window of real traffic (``controlplane/experiments``): the prompt-length and
output-length distributions as fine histograms that keep the long tail, the
arrival rate and its burstiness, and the share of prompt tokens the prefix
cache served. Never the users' text.

Design note. Replay turns a workload back into requests (``sample``), pure
and seeded:

* lengths are drawn jointly, as captured: a (prompt bucket, output bucket)
  pair of the joint histogram by its count, then uniformly inside each (the
  buckets are a few percent wide, so the drawn distribution follows the
  captured one to within KS noise). A workload stored before the joint
  histogram existed draws the two independently from their marginals;
* arrivals are a gamma renewal process at the recorded rate whose gaps have
  the recorded coefficient of variation (1 is Poisson; above 1, bursts),
  observed from a stationary start: the window opens at a random moment of
  the process, not on an arrival. Over a duration, the count is the
  recorded rate times the duration exactly and the gaps are the process's
  conditioned on that count (gamma gaps scaled to their sum): a fresh
  process started at t=0 offers a bursty capture several times its rate,
  and two draws of one rate differed by 60%, so repeats compared the load,
  not the arms. The same seed is the same arrival and length sequence for
  every arm (paired repeats);
* prefix sharing: a share of the requests starts with a prefix common to
  all of them (a seeded "system prompt"), as long as makes the cached share
  of prompt tokens the recorded one *within this replay*, counting that the
  first such request on each cache (each worker) computes it cold; the rest
  of each prompt is its own. The cache is reset before a replay, so each arm
  builds its own hits rather than inheriting an earlier arm's. A high share
  over few requests can fall short (a short first prompt on a cache stores
  a short prefix); the arm's measured share shows it;
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
    # (prompt bucket, output bucket, count) over the two histograms' buckets:
    # the lengths as they came together. Empty in a spec stored before it
    # existed: the lengths are then drawn independently.
    joint: tuple[tuple[int, int, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["prompt_tokens"] = self.prompt_tokens.to_dict()
        data["output_tokens"] = self.output_tokens.to_dict()
        data["joint"] = [list(cell) for cell in self.joint]
        return data

    def lengths(self, rng: random.Random) -> tuple[int, int]:
        """One (prompt tokens, output tokens) pair, drawn jointly when the
        spec has the joint histogram."""
        if not self.joint:
            return self.prompt_tokens.sample(rng), self.output_tokens.sample(rng)
        i, j, _ = rng.choices(self.joint, weights=[c for _, _, c in self.joint])[0]
        p, o = self.prompt_tokens.edges, self.output_tokens.edges
        return rng.randrange(p[i], p[i + 1]), rng.randrange(o[j], o[j + 1])

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
            joint=tuple((int(i), int(j), int(c)) for i, j, c in data.get("joint") or ()),
        )


def joint_histogram(
    prompt: Histogram, output: Histogram, pairs: Sequence[tuple[int, int]]
) -> tuple[tuple[int, int, int], ...]:
    """Counts of (prompt bucket, output bucket) over the two histograms' buckets."""
    counts: dict[tuple[int, int], int] = {}
    for p, o in pairs:
        i = bisect.bisect_right(prompt.edges, max(1, p)) - 1
        j = bisect.bisect_right(output.edges, max(1, o)) - 1
        counts[(i, j)] = counts.get((i, j), 0) + 1
    return tuple((i, j, c) for (i, j), c in sorted(counts.items()))


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
    prompt_hist = Histogram.of([o.prompt_tokens for o in observed])
    output_hist = Histogram.of([o.output_tokens for o in observed])
    return WorkloadSpec(
        prompt_tokens=prompt_hist,
        output_tokens=output_hist,
        rate_per_second=len(observed) / active if active > 0 else float(len(observed)),
        burstiness=cv,
        prefix_hit_share=cached_total / prompt_total if prompt_total else 0.0,
        prefix_request_share=sum(1 for o in observed if o.cached_tokens > 0) / len(observed),
        num_requests=len(observed),
        duration_seconds=duration_seconds,
        joint=joint_histogram(prompt_hist, output_hist, [(o.prompt_tokens, o.output_tokens) for o in observed]),
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
    """Gamma renewal arrivals (mean gap 1/rate, coefficient of variation
    ``cv``) seen from a stationary start: the first gap is the residual of
    the gap the window opens in (a length-biased gap, cut uniformly). Over
    ``duration_seconds`` alone: exactly ``round(rate × duration)`` arrivals,
    the gaps conditioned on that count (see the design note)."""
    shape = 1.0 / max(cv, 0.05) ** 2
    scale = 1.0 / (max(rate, 1e-9) * shape)
    first = rng.gammavariate(shape + 1.0, scale) * rng.random()
    if duration_seconds is not None and num_requests is None:
        n = round(rate * duration_seconds)
        if n <= 0:
            return []
        # n arrivals, then the wait past the last one to the window's end.
        gaps = [first, *(rng.gammavariate(shape, scale) for _ in range(n))]
        total = sum(gaps)
        if total <= 0:  # every gap underflowed: evenly spaced is the limit
            return [duration_seconds * (k + 1) / (n + 1) for k in range(n)]
        times, t = [], 0.0
        for gap in gaps[:n]:
            t += gap
            times.append(t * duration_seconds / total)
        return times
    times = []
    t = first
    if duration_seconds is not None and t >= duration_seconds:
        return times
    times.append(t)
    if num_requests is not None and len(times) >= num_requests:
        return times
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
    num_caches: int = 1,
) -> list[PlannedRequest]:
    """Seeded requests of the workload's lengths, rate and prefix sharing
    (see the design note); over ``duration_seconds`` or ``num_requests``.
    ``num_caches``: the prefix caches the requests are dealt to round-robin
    (one per worker), each starting cold. One seed gives the same arrivals,
    lengths and token ids whatever the block size; only where the shared
    prefix ends moves to a block boundary."""
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
    lengths = []
    for _ in times:
        prompt, output = spec.lengths(rng)
        if max_model_len is not None:
            output = min(output, max(1, max_model_len // 4))
            prompt = max(1, min(prompt, max_model_len - output))
        lengths.append((prompt, output))
    reusing = [rng.random() < spec.prefix_request_share for _ in times] if spec.prefix_hit_share > 0 else []
    own = [[rng.choice(vocabulary) for _ in range(prompt)] for prompt, _ in lengths]
    longest = max((prompt for prompt, _ in lengths), default=0)
    shared = [rng.choice(vocabulary) for _ in range(longest)]
    prompts = [prompt for prompt, _ in lengths]
    num_blocks = prefix_blocks(prompts, reusing, spec.prefix_hit_share, block_size, num_caches)
    planned: list[PlannedRequest] = []
    for k, (t, (prompt, output)) in enumerate(zip(times, lengths, strict=True)):
        prefix = _prefix(prompt, num_blocks, block_size) if reusing and reusing[k] else 0
        ids = shared[:prefix] + own[k][prefix:]
        planned.append(PlannedRequest(t, "completions", output, prompt_token_ids=ids, target_prompt_tokens=prompt))
    return planned


def _prefix(prompt: int, num_blocks: int, block_size: int) -> int:
    """The shared prefix of a reusing prompt: ``num_blocks`` whole blocks, and
    always a whole block short of its last token (which the engine computes)."""
    return min(num_blocks * block_size, (prompt - 1) // block_size * block_size)


def prefix_blocks(
    prompts: Sequence[int], reusing: Sequence[bool], hit_share: float, block_size: int, num_caches: int = 1
) -> int:
    """The shared prefix's length, in blocks, whose hits come closest to
    ``hit_share`` of the prompt tokens when the requests are dealt
    round-robin to ``num_caches`` cold caches: a reusing request hits as much
    of its prefix as an earlier one on its cache stored."""
    total = sum(prompts)
    if not total or hit_share <= 0 or not any(reusing):
        return 0

    def hits(num_blocks: int) -> int:
        stored = [0] * max(1, num_caches)
        hit = 0
        for k, (prompt, reuses) in enumerate(zip(prompts, reusing, strict=False)):
            if reuses:
                prefix = _prefix(prompt, num_blocks, block_size)
                cache = k % len(stored)
                hit += min(prefix, stored[cache])
                stored[cache] = max(stored[cache], prefix)
        return hit

    target = hit_share * total
    low, high = 0, max(prompts) // block_size + 1
    while low < high:  # the fewest blocks whose hits reach the target (hits rise with the length)
        mid = (low + high) // 2
        if hits(mid) >= target:
            high = mid
        else:
            low = mid + 1
    if low > 0 and abs(hits(low - 1) - target) <= abs(hits(low) - target):
        return low - 1
    return low


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
