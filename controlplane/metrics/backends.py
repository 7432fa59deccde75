"""Where scraped figures come from: the one interface the query layer reads
them through (``METRICS_BACKEND``).

* ``Database``: the control plane scrapes every worker itself and computes
  each figure from its stored snapshots (``query.py`` holds that arithmetic
  and hands it to this class).
* ``Prometheus``: an operator's Prometheus (or Thanos, Mimir: the same HTTP
  API) at ``PROMETHEUS_URL`` scrapes the workers; each figure is its
  registry PromQL compiled by ``deploy.expression`` (the compiler that
  writes the shipped recording rules and dashboard, so the two backends
  cannot drift) and read with ``/api/v1/query`` (one window) or
  ``/api/v1/query_range`` (a series). The control plane then scrapes nothing.

Figures from the gateway's request log are not the backend's: they stay on
the database whichever backend is chosen.

A Prometheus that is down, slow (past ``PROMETHEUS_TIMEOUT_SECONDS``) or
answers with an error raises ``BackendUnavailable``: the API answers 503,
pages say "metrics backend unavailable", a rollout's measurement is
inconclusive and the alert evaluator skips the cycle.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import httpx
import numpy as np

from controlplane.metrics import conf, deploy
from controlplane.metrics.figures import Figure
from controlplane.metrics.promql import Floats

Series = dict[str, dict[str, list[float | None]]]  # figure → group → one value per point
WorkerSamples = dict[str, tuple[np.ndarray, dict[str, np.ndarray]]]  # worker → (times, key → values)
UNAVAILABLE = "metrics backend unavailable"
DATABASE, PROMETHEUS = "database", "prometheus"
FLEET = "fleet"
NO_POOL = "(no pool)"
# A worker whose pool is in no routing table takes no gateway traffic: what
# it serves is an experiment's replay on a lab worker.
NO_COHORT = "lab (no routing table)"
# A group's name when its label is empty, for both backends (``query.group_of``).
EMPTY_GROUP = {"pool": NO_POOL, "cohort": NO_COHORT}


class BackendUnavailable(RuntimeError):
    """The metrics backend did not answer (down, slow, or an error)."""

    def __init__(self, reason: str):
        super().__init__(f"{UNAVAILABLE}: {reason}")
        self.reason = reason


class Backend(Protocol):
    name: str
    scrapes: bool  # whether the control plane scrapes the workers itself

    def scrape_figures(
        self,
        chosen: Sequence[Figure],
        window: float,
        group_by: str,
        selector: Mapping[str, str],
        points: Floats,
        *,
        dense: bool,
    ) -> Series:
        """Each figure per group at each point, over the window ending there.
        ``dense``: a series (points evenly spaced, or so but for the last,
        which may be nearer: an aligned range), else one point."""
        ...


Evaluate = Callable[[Sequence[Figure], float, str, Mapping[str, str], Floats, bool], Series]


class Database:
    name = DATABASE
    scrapes = True

    def __init__(self, evaluate: Evaluate):
        self._evaluate = evaluate

    def scrape_figures(
        self,
        chosen: Sequence[Figure],
        window: float,
        group_by: str,
        selector: Mapping[str, str],
        points: Floats,
        *,
        dense: bool,
    ) -> Series:
        return self._evaluate(chosen, window, group_by, selector, points, dense)


def promql_duration(seconds: float) -> str:
    """A window as PromQL writes it: whole milliseconds, which every range accepts."""
    return f"{max(1, round(seconds * 1000))}ms"


def _matchers(selector: Mapping[str, str]) -> str:
    # The selector's keys are the service discovery's labels (worker, pool,
    # cohort); a JSON string is a valid PromQL string literal.
    return ", ".join(f"{key}={json.dumps(value)}" for key, value in sorted(selector.items()))


def compile_figure(f: Figure, window: float, group_by: str, selector: Mapping[str, str]) -> str:
    """The figure's PromQL over ``window``, grouped and selected as the query layer asks."""
    grouping = "" if group_by == FLEET else group_by
    expr = deploy.expression(f, grouping=grouping, window=promql_duration(window), selector=_matchers(selector))
    return expr.replace("(le, )", "(le)")


def _value(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


class Prometheus:
    name = PROMETHEUS
    scrapes = False

    def __init__(self, url: str, timeout_seconds: float):
        if not url:
            raise BackendUnavailable("METRICS_BACKEND=prometheus needs PROMETHEUS_URL")
        self.url = url.rstrip("/")
        self.timeout_seconds = timeout_seconds
        self._local = threading.local()

    @property
    def _http(self) -> httpx.Client:
        # One keep-alive client per thread: a page's dozen queries reuse one connection.
        client: httpx.Client | None = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = httpx.Client(base_url=self.url, timeout=self.timeout_seconds)
        return client

    def api(self, path: str, params: Mapping[str, str]) -> Any:
        """One API call's ``data``, or BackendUnavailable."""
        # Prometheus stops evaluating at its own timeout too, so a slow query frees the server.
        params = {**params, "timeout": f"{self.timeout_seconds:g}s"}
        try:
            reply = self._http.post(f"/api/v1/{path}", data=params)
        except httpx.TimeoutException:
            raise BackendUnavailable(f"{self.url} did not answer within {self.timeout_seconds:g} s") from None
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"{self.url}: {type(exc).__name__}: {exc}") from None
        try:
            body = reply.json()
        except ValueError:
            raise BackendUnavailable(f"{self.url} answered {reply.status_code}, not JSON") from None
        if reply.status_code != 200 or body.get("status") != "success":
            raise BackendUnavailable(
                f"{self.url} answered {reply.status_code}: {body.get('errorType', '')} {body.get('error', '')}".strip()
            )
        return body["data"]

    def _group(self, metric: Mapping[str, str], group_by: str) -> str:
        if group_by == FLEET:
            return FLEET
        return metric.get(group_by, "") or EMPTY_GROUP.get(group_by, "")

    def scrape_figures(
        self,
        chosen: Sequence[Figure],
        window: float,
        group_by: str,
        selector: Mapping[str, str],
        points: Floats,
        *,
        dense: bool,
    ) -> Series:
        # One query per figure, sent together: a page's dozen figures cost
        # about one round trip, not twelve.
        if len(chosen) == 1:
            return {chosen[0].name: self._figure(chosen[0], window, group_by, selector, points)}
        done = list(_pool().map(lambda f: self._figure(f, window, group_by, selector, points), chosen))
        return {f.name: series for f, series in zip(chosen, done, strict=True)}

    def _figure(
        self, f: Figure, window: float, group_by: str, selector: Mapping[str, str], points: Floats
    ) -> dict[str, list[float | None]]:
        if len(points) > 2 and abs(float(points[-1] - points[-2]) - float(points[1] - points[0])) > 1e-6:
            # An aligned range (points on the step's grid, the last at now):
            # the grid in one range query, the live point in an instant one.
            grid = self._figure(f, window, group_by, selector, points[:-1])
            live = self._figure(f, window, group_by, selector, points[-1:])
            return {g: grid.get(g, [None] * (len(points) - 1)) + live.get(g, [None]) for g in sorted({*grid, *live})}
        expr = compile_figure(f, window, group_by, selector)
        series: dict[str, list[float | None]] = {}
        if len(points) == 1:
            data = self.api("query", {"query": expr, "time": f"{points[0]:.3f}"})
            for item in data["result"]:
                series[self._group(item["metric"], group_by)] = [_value(item["value"][1])]
        else:
            step = float(points[1] - points[0])
            data = self.api(
                "query_range",
                {"query": expr, "start": f"{points[0]:.3f}", "end": f"{points[-1]:.3f}", "step": f"{step:.3f}"},
            )
            for item in data["result"]:
                values: list[float | None] = [None] * len(points)
                for t, text in item["values"]:
                    i = int(round((float(t) - float(points[0])) / step))
                    if 0 <= i < len(points):
                        values[i] = _value(text)
                series[self._group(item["metric"], group_by)] = values
        if group_by == FLEET:
            series.setdefault(FLEET, [None] * len(points))
        return dict(sorted(series.items()))

    # ---- raw series, for readers that judge samples, not figures (the advisor) ----

    def _selection(self, keys: Sequence[str], selector: Mapping[str, str]) -> str:
        names = "|".join(sorted(keys))  # series names: [a-z_:] only, nothing to escape
        return f'{{__name__=~"{names}"{", " + _matchers(selector) if selector else ""}}}'

    def samples(
        self, keys: Sequence[str], selector: Mapping[str, str], start: float, end: float, step: float | None = None
    ) -> WorkerSamples:
        """The series ``keys`` of each worker ``selector`` picks, in (start, end]:
        every stored sample (``step`` None), or the value at each ``step``
        back from ``end``. Per worker label: the sample times and, per key,
        one value per time (NaN where that series has none)."""
        selection = self._selection(keys, selector)
        if step is None:
            data = self.api("query", {"query": f"{selection}[{promql_duration(end - start)}]", "time": f"{end:.3f}"})
        else:
            first = end - step * max(0, math.floor((end - start) / step - 1e-9))
            params = {"query": selection, "start": f"{first:.3f}", "end": f"{end:.3f}", "step": f"{step:.3f}"}
            data = self.api("query_range", params)
        found: dict[str, dict[str, dict[float, float]]] = {}
        for item in data["result"]:
            by_time = found.setdefault(item["metric"].get("worker", ""), {}).setdefault(item["metric"]["__name__"], {})
            for t, text in item["values"]:
                by_time[round(float(t), 3)] = float(text)
        out: WorkerSamples = {}
        for worker, series in found.items():
            times = sorted({t for by_time in series.values() for t in by_time})
            out[worker] = (
                np.array(times, dtype=np.float64),
                {k: np.array([series.get(k, {}).get(t, math.nan) for t in times], dtype=np.float64) for k in keys},
            )
        return out

    def increases(
        self, keys: Sequence[str], window: float, selector: Mapping[str, str], at: float
    ) -> dict[str, float | None]:
        """``sum(increase(key[window]))`` over what ``selector`` picks, per
        counter key; None where no series had data."""
        sel = f"{{{_matchers(selector)}}}" if selector else ""
        duration = promql_duration(window)

        def one(key: str) -> float | None:
            result = self.api("query", {"query": f"sum(increase({key}{sel}[{duration}]))", "time": f"{at:.3f}"})
            return _value(result["result"][0]["value"][1]) if result["result"] else None

        return dict(zip(keys, _pool().map(one, keys), strict=True))

    def count_workers(self, key: str, window: float, selector: Mapping[str, str], at: float) -> int:
        """How many workers served ``key`` within the window."""
        sel = f"{{{_matchers(selector)}}}" if selector else ""
        expr = f"count(count by (worker) (last_over_time({key}{sel}[{promql_duration(window)}])))"
        result = self.api("query", {"query": expr, "time": f"{at:.3f}"})["result"]
        return int(float(result[0]["value"][1])) if result else 0


_prometheus: dict[tuple[str, float], Prometheus] = {}
_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="prometheus-query")
        return _executor


def chosen_name() -> str:
    name = conf.METRICS_BACKEND.get().strip().lower()
    if name not in (DATABASE, PROMETHEUS):
        raise ValueError(f"METRICS_BACKEND={name!r}: expected {DATABASE} or {PROMETHEUS}")
    return name


def current(database: Backend) -> Backend:
    """The configured backend (``database`` is the query layer's own)."""
    if chosen_name() == DATABASE:
        return database
    key = (conf.PROMETHEUS_URL.get(), conf.PROMETHEUS_TIMEOUT_SECONDS.get())
    backend = _prometheus.get(key)
    if backend is None:
        backend = _prometheus[key] = Prometheus(*key)
    return backend


def scrapes() -> bool:
    """Whether the control plane scrapes the workers itself (not when Prometheus does)."""
    return chosen_name() == DATABASE
