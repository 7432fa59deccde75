"""The advisor's kept reports: the last one per pool and for the fleet, so the
page opens at once ("Apps" in docs/architecture.md).

``AdvisorReport.refresh`` gathers the inputs (``inputs.py``) and judges them
(``verdicts.py``); beat's ``advisor.refresh`` runs it for every pool and the
fleet. A report for another window is computed on demand and not kept.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import Any

from django.db import models
from django.utils import timezone

from controlplane.advisor import conf, inputs, pd, verdicts
from controlplane.fleet.models import Pool

FLEET = "fleet"


def compute(
    pool: Pool | None,
    window_seconds: float,
    now: datetime,
    *,
    tbt_objective_seconds: float | None = None,
    database_estimate: bool = False,
) -> dict[str, Any]:
    """The report for ``pool`` (None: the fleet) over the window ending
    ``now``, as JSON; the TBT objective is the operator's TPOT objective
    unless given. The PD database sweep runs only with ``database_estimate``
    (beat's round: it takes seconds); otherwise the kept report's is reused
    when its inputs match."""
    thresholds = inputs.thresholds()
    gathered = inputs.gather(pool, window_seconds, now, tbt_objective_seconds=tbt_objective_seconds)
    kept = AdvisorReport.objects.filter(scope=pool.name if pool is not None else FLEET).first()
    kept_estimate = ((kept.body.get("pd_database") or {}).get("chart") or {}).get("estimate") if kept else None
    estimate = pd.for_pool(
        pool, gathered.requests, thresholds, tbt_objective_seconds, run=database_estimate, kept=kept_estimate
    )
    report = verdicts.advise(replace(gathered, pd_database=estimate), thresholds)
    return {
        "scope": pool.name if pool is not None else FLEET,
        "window_seconds": window_seconds,
        "computed_at": now.isoformat(),
        **report.to_json(),
    }


def findings_of(body: dict[str, Any]) -> list[str]:
    """The keys of every answer that says yes: what changed between two reports."""
    answers = [
        *body.get("questions", []),
        body.get("head_of_line", {}),
        *body.get("tuning", []),
        body.get("pd", {}),
        body.get("pd_database") or {},
    ]
    return sorted(a["key"] for a in answers if a and a.get("answer") == verdicts.Answer.YES.value)


class AdvisorReport(models.Model):
    scope = models.CharField(max_length=100, unique=True, help_text="a pool's name, or 'fleet'")
    pool = models.ForeignKey(Pool, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    window_seconds = models.FloatField()
    computed_at = models.DateTimeField()
    overall = models.CharField(max_length=20, help_text="worth_it, not_worth_it, other_cause, not_enough_data")
    findings = models.JSONField(default=list, help_text="the keys of the answers that say yes")
    previous_findings = models.JSONField(default=list, help_text="the same, one report earlier")
    findings_changed_at = models.DateTimeField(null=True, blank=True)
    body = models.JSONField()

    class Meta:
        ordering = ["scope"]

    def __str__(self) -> str:
        return f"advisor {self.scope}: {self.overall}"

    @property
    def appeared(self) -> list[str]:
        """Findings in this report that the one before did not have."""
        return sorted(set(self.findings) - set(self.previous_findings))

    @classmethod
    def refresh(
        cls,
        pool: Pool | None,
        *,
        window_seconds: float | None = None,
        now: datetime | None = None,
        database_estimate: bool = False,
    ) -> AdvisorReport:
        """Compute and keep the report; safe to run twice (the newer one stays).
        ``database_estimate``: sweep the PD database (seconds; beat's round)."""
        now = now or timezone.now()
        window = window_seconds or conf.ADVISOR_WINDOW_SECONDS.get()
        body = compute(pool, window, now, database_estimate=database_estimate)
        scope = pool.name if pool is not None else FLEET
        found = findings_of(body)
        kept = cls.objects.filter(scope=scope).first()
        if kept is None:
            return cls.objects.create(
                scope=scope,
                pool=pool,
                window_seconds=window,
                computed_at=now,
                overall=body["overall"],
                findings=found,
                previous_findings=found,
                findings_changed_at=now,
                body=body,
            )
        if kept.computed_at > now:
            return kept
        if found != kept.findings:
            kept.previous_findings, kept.findings_changed_at = kept.findings, now
        kept.findings = found
        kept.pool, kept.window_seconds, kept.computed_at = pool, window, now
        kept.overall, kept.body = body["overall"], body
        kept.save()
        return kept

    @classmethod
    def refresh_all(cls, now: datetime | None = None, *, database_estimate: bool = False) -> int:
        """Every pool that has workers, and the fleet; reports of pools gone are dropped."""
        now = now or timezone.now()
        pools = list(Pool.objects.filter(workers__isnull=False).distinct().select_related("desired_revision"))
        for pool in pools:
            cls.refresh(pool, now=now, database_estimate=database_estimate)
        cls.refresh(None, now=now, database_estimate=database_estimate)
        cls.objects.exclude(scope=FLEET).exclude(pool__in=pools).delete()
        return len(pools) + 1
