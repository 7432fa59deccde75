"""Reading many queries' figures at one time, each stored window read once:
the alert evaluator's batched door to the metrics (``Reader.read``).

``metrics.query.query_many`` answers one (window, grouping, selector) at a
time: it reads the window's data and computes each figure group by group.
An alert evaluation cycle asks for dozens of such combinations over the same few
windows, so this reads instead:

* scraped figures: each window's first/last snapshots of every target once
  (the query layer's ``point_windows``, no selector), then selects and
  groups them in memory — a selector is a filter on the target's labels,
  exactly as the query layer applies it in SQL. The groups are then stacked
  along the points axis (group i is row i; a group's j-th target is layer
  j) and each figure is computed in one vectorised call: the figure
  arithmetic is pointwise and reads NaN as no data, so each row comes out
  as it would alone.
* request-log figures: the log over the longest window asked for, once
  (and between cycles only the rows that arrived since: ``request_log``);
  each figure's window arithmetic (``_per_window``) takes the rows inside
  its own window, and a group exists when it has rows in that window.

``tests/controlplane/metrics/test_reader.py`` holds the result equal to
``query_many`` for every figure, grouping, selector and window, so a change
in the metrics layer that breaks the equivalence fails there.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

import numpy as np

from controlplane.fleet.models import Pool, Worker
from controlplane.gateway.inflight import STATUS_STREAM_TIMED_OUT
from controlplane.metrics import figures, query, request_log
from controlplane.metrics.figures import Figure, Objectives, RequestRows, TargetWindows

Values = dict[str, dict[str, float | None]]  # figure → group → value


def _clean(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


class Reader:
    def __init__(self, now: datetime, *, peak_windows: set[float] | None = None, request_window: float = 0.0):
        self.now = now
        self.points = np.array([now.timestamp()])
        self._peak_windows = peak_windows or set()
        self._request_window = request_window
        self._targets: dict[float, list[TargetWindows]] = {}
        self._log_rows: _Log | None = None
        self._log_window = 0.0
        self._objectives: Objectives | None = None

    def read(self, names: Sequence[str], window: float, group_by: str, selector: Mapping[str, str]) -> Values:
        """What ``query_many(names, window, group_by, selector, now)`` answers."""
        chosen = [query.figure_named(name) for name in names]
        window = query.check_window(window)
        selector = query.check_selector(selector)
        for f in chosen:
            query.check_group_by(f, group_by)
        out: Values = {}
        scrape = [f for f in chosen if f.source == "scrape"]
        if scrape:
            out.update(self._scrape(scrape, window, group_by, selector))
        requests = [f for f in chosen if f.source == "requests"]
        if requests:
            out.update(self._requests(requests, window, group_by, selector))
        return out

    # ---- scraped figures -------------------------------------------------------------

    def _windows(self, window: float, needs_peak: bool) -> list[TargetWindows]:
        loaded = self._targets.get(window)
        if loaded is None:
            needs_peak = needs_peak or window in self._peak_windows
            loaded = self._targets[window] = query.point_windows(self.points, window, {}, needs_peak)
        return loaded

    def _scrape(self, chosen: Sequence[Figure], window: float, group_by: str, selector: Mapping[str, str]) -> Values:
        backend = query.backend()
        if backend is not query.DATABASE:
            # Prometheus answers each (figure, window, grouping, selector) itself.
            series = backend.scrape_figures(chosen, window, group_by, selector, self.points, dense=False)
            return {name: {g: values[0] for g, values in by_group.items()} for name, by_group in series.items()}
        loaded = self._windows(window, any(f.needs_peak_memory for f in chosen))
        grouped: dict[str, list[TargetWindows]] = defaultdict(list)
        for tw in loaded:
            if all(tw.labels.get(k) == v for k, v in selector.items()):
                grouped[query.group_of(tw.labels, group_by)].append(tw)
        if group_by == query.FLEET:
            grouped.setdefault(query.FLEET, [])
        out: Values = {f.name: {} for f in chosen}

        # Groups whose targets share a layout, stacked: group i is row i, and
        # its j-th target sits in layer j (rows of groups with fewer targets
        # are NaN there, which every figure reads as "no data", as it reads a
        # target with fewer than two samples). One call per figure and layout.
        by_layout: dict[str, list[tuple[str, list[TargetWindows]]]] = defaultdict(list)
        for group, tws in grouped.items():
            digests = {tw.layout.digest for tw in tws}
            if len(digests) == 1:
                by_layout[digests.pop()].append((group, tws))
        for members in by_layout.values():
            layout = members[0][1][0].layout
            num_layers = max(len(tws) for _, tws in members)
            layers = []
            for j in range(num_layers):
                increases = np.full((len(members), len(layout)), np.nan)
                peak = np.full(len(members), np.nan)
                for i, (_, tws) in enumerate(members):
                    if j < len(tws):
                        increases[i] = tws[j].increases[0]
                        peak[i] = tws[j].peak_memory[0]
                layers.append(
                    TargetWindows(labels={}, layout=layout, increases=increases, peak_memory=peak, range_seconds=window)
                )
            batch = figures.Group(layers, len(members))
            for f in chosen:
                values = f.from_group(batch)
                for (group, _), value in zip(members, values, strict=True):
                    out[f.name][group] = _clean(value)

        # Groups mixing layouts (a worker that changed engine in the window), and
        # the fleet's empty group, one by one as the query layer does.
        for group, tws in grouped.items():
            if len({tw.layout.digest for tw in tws}) != 1:
                one = figures.Group(tws, 1)
                for f in chosen:
                    out[f.name][group] = _clean(f.from_group(one)[0])
        return {name: dict(sorted(values.items())) for name, values in out.items()}

    # ---- request-log figures ------------------------------------------------------------

    def _log(self, window: float) -> _Log:
        """The log over the longest window wanted (kept between cycles, see
        ``request_log``), with each row's worker, pool and cohort as codes."""
        if self._log_rows is not None and self._log_window >= window:
            return self._log_rows
        longest = max(window, self._request_window)
        end = float(self.points[-1])
        log = request_log.window(end - longest, end)
        rows = RequestRows(
            created=log.created,
            # query.is_ok and query.is_failed, over arrays (the reader test holds them equal).
            ok=(log.status == 200) & ~log.has_error,
            failed=(log.status >= 500) | (log.status == 429) | ((log.status == 200) & log.has_error),
            ttft=log.ttft,
            tpot=log.tpot,
            max_gap=log.max_gap,
            e2e=log.e2e,
            timed_out=log.status == STATUS_STREAM_TIMED_OUT,
            cancelled=log.status == query.STATUS_CLIENT_GONE,
        )

        def by_id(numbers: np.ndarray, model: Any) -> tuple[list[str], np.ndarray]:
            uniques, codes = np.unique(numbers, return_inverse=True)
            named = dict(model.objects.filter(pk__in=[int(u) for u in uniques if u >= 0]).values_list("pk", "name"))
            return [named.get(int(u), "") for u in uniques], codes

        table: dict[str, int] = {}
        cohort_codes = np.fromiter(
            (table.setdefault(c, len(table)) for c in log.cohorts.tolist()), dtype=np.intp, count=len(log)
        )
        self._log_rows = (
            _Log(
                rows,
                {
                    "worker": by_id(log.worker_ids, Worker),
                    "pool": by_id(log.pool_ids, Pool),
                    "cohort": (list(table), cohort_codes),
                },
            )
            if len(log)
            else _Log(rows, {})
        )
        self._log_window = longest
        return self._log_rows

    def _requests(self, chosen: Sequence[Figure], window: float, group_by: str, selector: Mapping[str, str]) -> Values:
        log = self._log(window)
        selected = None
        for key, value in selector.items():
            hits = log.matches(key, value)
            selected = hits if selected is None else selected & hits
        names, codes, order, bounds, by_group = log.grouped(group_by)
        # A group exists when it has rows in this window (the query layer reads only those).
        in_window = log.rows.created > self.points[-1] - window
        if selected is not None:
            in_window &= selected
        present = {names[c] for c in np.unique(codes[in_window]).tolist()}
        if group_by == query.FLEET:
            present.add(query.FLEET)
        if self._objectives is None:
            self._objectives = query.objectives_now()
        index = {name: i for i, name in enumerate(names)}
        kept = selected[order] if selected is not None else None
        # Every group is a share of the selected rows' stream (RequestRows.stream), as in the query layer.
        stream = log.rows.created if selected is None else log.rows.created[selected]
        out: Values = {f.name: {} for f in chosen}
        for group in sorted(present):
            i = index.get(group)
            if i is None:
                group_rows = RequestRows.empty()
            else:
                # The group's rows are one run of the group-sorted log, still in arrival order.
                group_rows = by_group.take(slice(bounds[i], bounds[i + 1]))
                if kept is not None:
                    group_rows = group_rows.take(kept[bounds[i] : bounds[i + 1]])
            group_rows = replace(group_rows, stream=stream)
            for f in chosen:
                out[f.name][group] = _clean(f.from_requests(group_rows, self.points, window, self._objectives)[0])
        return out


class _Log:
    """The request log of a cycle, with each row's labels as integer codes."""

    def __init__(self, rows: RequestRows, labels: dict[str, tuple[list[str], np.ndarray]]):
        self.rows = rows
        self._labels = labels
        self._grouped: dict[str, tuple[list[str], np.ndarray, np.ndarray, np.ndarray, RequestRows]] = {}

    def matches(self, key: str, value: str) -> np.ndarray:
        names, codes = self._labels.get(key, ([], np.zeros(0, dtype=np.intp)))
        if value not in names:
            return np.zeros(len(self.rows.created), dtype=bool)
        return codes == names.index(value)

    def grouped(self, group_by: str) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, RequestRows]:
        """Group names as ``query.group_of`` names them; each row's group; the
        stable order that sorts rows by group; each group's run in that order;
        and the rows in that order."""
        if group_by not in self._grouped:
            n = len(self.rows.created)
            if group_by == query.FLEET or not n:
                names, codes = [query.FLEET], np.zeros(n, dtype=np.intp)
            else:
                raw_names, codes = self._labels[group_by]
                empty = {"pool": query.NO_POOL, "cohort": query.NO_COHORT}.get(group_by, "")
                names = [name if name != "" else empty for name in raw_names]
            order = np.argsort(codes, kind="stable")
            bounds = np.searchsorted(codes[order], np.arange(len(names) + 1))
            self._grouped[group_by] = (names, codes, order, bounds, self.rows.take(order))
        return self._grouped[group_by]
