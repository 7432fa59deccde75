"""Predict mode: an experiment's arms in virtual time on the simulated
device of its lab worker's own GPU and model, driven one step per Celery
task from stored state, as ``runner`` drives a measured one.

Design note. ``drive(experiment_id)`` claims the experiment's lease
(``runner.claim``), does the next step and releases it; the lease is
renewed and the abort flag read every half second while a step works (the
work runs in a thread beside the renewals):

1. pending → the device (``workers.predict.target``): a simulated worker's
   own, rebuilt from what it reported (its hardware's ``sim``); for a
   reference worker, the step-time table fitted to the reference engine on
   this machine, fitted now when the data dir holds none yet (about 100 s)
   and reused after; → running.
2. running → one **round**: the next repeat of every arm. Repeat ``r`` is
   sampled exactly as the measured runner samples it (``runner.planner``:
   the same workload, seed ``r``, arrival window, rate scale, block size
   and context length) and split round-robin over the workers as their
   replay is, each share on its own cold simulated engine (a measured
   repeat starts with its prefix caches reset). Each arm's result is stored
   as taken, in the shape of a measured repeat (``predicted: true``), so
   ``recommend`` and the pages read it unchanged. After at least the
   experiment's repeats (and two: one has no interval) the recommendation
   is judged on what is in; the prediction stops when it is **narrow**: a
   winner clear of every other arm, no arm qualifying, or every arm's
   interval against the baseline within ``MIN_EFFECT`` of the baseline's
   score, or after ``PREDICT_MAX_REPEATS`` rounds.
3. → succeeded with the recommendation (``runner.finish``). No worker is
   cordoned or moved: there is nothing to restore.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from controlplane.experiments import conf, measure, runner
from controlplane.experiments.models import PREDICT_MAX_REPEATS, Arm, ArmStatus, Experiment, Phase
from controlplane.experiments.recommend import MIN_EFFECT, MIN_REPEATS, Outcome, Recommendation
from controlplane.fleet.models import Worker
from workers import predict
from workers.profile import EngineProfile, ProfileError

log = logging.getLogger(__name__)
T = TypeVar("T")
# The longest one piece of work may take while the lease is renewed beside it.
WORK_TIMEOUT_SECONDS = 3600.0

# Devices by what they rest on: rebuilding one loads the kernel database (seconds), once per process.
_targets: dict[str, predict.Target] = {}


def reference_model_dir() -> Path:
    """The checkpoint reference workers serve: the one replay prompts are
    built from (``EXPERIMENT_TOKENIZER_DIR``, as the demo sets it), else the
    shipped tiny model."""
    configured = conf.EXPERIMENT_TOKENIZER_DIR.get()
    return Path(configured) if configured else predict.shipped_model_dir()


def reference_table() -> Path:
    """Where the fitted table for reference workers is kept (under the data dir)."""
    return predict.fitted_table_path(Path(settings.DATA_DIR), reference_model_dir())


def lab_worker(exp: Experiment) -> Worker:
    return exp.workers.order_by("name")[0]


def _target(worker: Worker) -> predict.Target:
    table = reference_table()
    fitted = table.stat().st_mtime_ns if worker.engine_kind == "reference" and table.exists() else 0
    key = f"{worker.engine_kind}:{(worker.hardware or {}).get('sim')}:{table}:{fitted}"  # a refit is a new device
    if key not in _targets:
        _targets[key] = predict.target(worker.engine_kind, worker.hardware, table=table)
    return _targets[key]


def _beside_renewals(lease: runner.Lease, work: Callable[[], T]) -> T:
    """Run ``work`` in a thread while this one renews the lease; raises
    runner.Aborted when the flag goes up (the work is left to finish on its own)."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="experiment-predict")
    try:
        future = executor.submit(work)
        runner._wait(lease, WORK_TIMEOUT_SECONDS, future.done)
        return future.result()
    finally:
        executor.shutdown(wait=False)


# ---- the loop ------------------------------------------------------------------------------


def drive(experiment_id: int) -> bool:
    """Claim, do the next step, release. True when there is more to do."""
    lease = runner.claim(experiment_id)
    if lease is None:
        return False
    try:
        more = step(experiment_id, lease)
    except runner.LeaseLost:
        log.info("experiment %s: another runner took over", experiment_id)
        return False
    lease.release()
    return more


def step(experiment_id: int, lease: runner.Lease) -> bool:
    exp = Experiment.objects.get(pk=experiment_id)
    phase = Phase(exp.phase)
    if phase.finished:
        return False
    try:
        if exp.abort_requested:
            raise runner.Aborted()
        if phase == Phase.PENDING:
            prepare(exp, lease)
            return True
        target = _target(lab_worker(exp))
        run_round(exp, target, lease)
        if not done(exp):
            return True
        finish_arms(exp)
        runner.finish(exp, Phase.SUCCEEDED, message=f"finished: {exp.predicted_label}")
    except runner.Aborted:
        runner.finish(Experiment.objects.get(pk=experiment_id), Phase.ABORTED)
    except predict.CannotSimulate as exc:
        runner.finish(exp, Phase.FAILED, message=f"cannot predict on worker {lab_worker(exp).name}: {exc}")
    return False


# ---- 1. the device ----------------------------------------------------------------------------


def prepare(exp: Experiment, lease: runner.Lease) -> None:
    worker = lab_worker(exp)
    if worker.engine_kind == "reference" and not reference_table().exists():
        model_dir = reference_model_dir()
        exp.message = f"fitting the step-time table of {model_dir.name} on this machine (about 100 s, once)"
        Experiment.objects.filter(pk=exp.pk).update(message=exp.message)
        exp.set_progress(stage="fitting the step-time table", arm=0, num_arms=exp.arms.count())
        _beside_renewals(lease, lambda: predict.fit_reference_table(model_dir, reference_table()))
    exp.set_progress(stage="loading the simulated device", arm=0, num_arms=exp.arms.count())
    target = _beside_renewals(lease, lambda: _target(worker))
    with transaction.atomic():
        exp = Experiment.objects.select_for_update().get(pk=exp.pk)
        exp.simulation = {
            "label": target.label,
            "worker": worker.name,
            "device": target.device.describe(),
            "tokenizer_dir": str(target.tokenizer_dir),
        }
        exp.phase, exp.started_at = Phase.RUNNING, timezone.now()
        exp.message = f"predicting on the simulated {target.label}"
        exp.save(update_fields=["simulation", "phase", "started_at", "message"])
        exp.record("started", None, {"mode": exp.mode, "simulation": exp.simulation})
        exp.changed()


# ---- 2. one round -------------------------------------------------------------------------------


def run_round(exp: Experiment, target: predict.Target, lease: runner.Lease) -> None:
    """The next repeat of every arm still running, each stored as taken."""
    arms = list(exp.arms.filter(status__lt=ArmStatus.SUCCEEDED).order_by("index"))
    if not arms:
        return
    workers = list(exp.workers.order_by("name"))
    num_arms = exp.arms.count()
    repeat = min(len(a.results) for a in arms)
    slos = exp.slos()
    max_model_len = min((w.max_model_len for w in workers if w.max_model_len), default=None)
    for arm in arms:
        if any(r["repeat"] == repeat for r in arm.results):
            continue
        if arm.status == ArmStatus.PENDING:
            Arm.objects.filter(pk=arm.pk).update(
                status=ArmStatus.RUNNING, attempts=F("attempts") + 1, started_at=timezone.now()
            )
        exp.message = f"arm {arm.index + 1} of {num_arms}: {arm.name}, predicting repeat {repeat + 1}"
        Experiment.objects.filter(pk=exp.pk).update(message=exp.message)
        exp.set_progress(
            stage=f"predicting repeat {repeat + 1} (up to {PREDICT_MAX_REPEATS})",
            arm=arm.index + 1,
            num_arms=num_arms,
            arm_name=arm.name,
        )
        try:
            planned = runner.drawn_or_failed(
                runner.planner(exp, arm, workers)(repeat, exp.duration_seconds, exp.rate_scale), exp
            )
            shares = [planned[i :: len(workers)] for i in range(len(workers))]
            profile = EngineProfile.from_dict(dict(arm.fields), engine_kind="reference", max_model_len=max_model_len)
            prediction = _beside_renewals(
                lease,
                functools.partial(
                    predict.predict,
                    target,
                    shares,
                    profile,
                    max_model_len=max_model_len,
                    ttft_seconds=slos["ttft"] / 1000,
                    tpot_seconds=slos["tpot"] / 1000,
                    seed=repeat,
                ),
            )
        except (runner.ArmFailed, ProfileError) as exc:
            fail(exp, arm, str(exc))
            continue
        store(exp, arm, repeat, prediction)


def result_of(exp: Experiment, repeat: int, attempt: int, p: predict.Prediction) -> dict[str, Any]:
    """A predicted repeat in the shape of a measured one (``runner.run_repeat``):
    the engines' own figures under the experiment's names."""
    f = p.figures
    failed = p.num_requests - p.num_finished
    return {
        "repeat": repeat,
        "attempt": attempt,
        "taken_at": timezone.now().isoformat(),
        "arrival_seconds": exp.duration_seconds,
        "predicted": True,
        "figures": {
            "output_throughput": f["output_throughput_tps"] or 0.0,
            "goodput": f["goodput_rps"] or 0.0,
            "client_ttft_p99": f["ttft_p99_seconds"],
            "client_stall_p99": f["stall_p99_seconds"],
            "client_itl_p99": f["itl_p99_seconds"],
            "client_tpot_p99": f["tpot_p99_seconds"],
            "failed_requests": failed,
            "num_requests": p.num_requests,
            "successful_requests": p.num_finished,
            "memory_peak_bytes": f.get("memory_peak_bytes"),
            "memory_mean_bytes": f.get("memory_mean_bytes"),
            "prefill_wait_p99": f.get("prefill_wait_p99_seconds"),
            "kv_fragmentation_mean": f.get("kv_fragmentation_mean"),
            "preemptions": f.get("preemptions"),
            "prefix_hit_share": f.get("prefix_hit_rate"),
            "prefix_cache_queries": p.prefix_cache_queries,
            "itl_p99": f["itl_p99_seconds"],
            "ttft_p99": f["ttft_p99_seconds"],
        },
        "client": {
            "num_requests": p.num_requests,
            "successful_requests": p.num_finished,
            "failed_requests": failed,
            "duration_seconds": p.duration_seconds,  # virtual: first arrival to last finish
            "total_input_tokens": p.prompt_tokens,
            "total_output_tokens": p.output_tokens,
        },
    }


def store(exp: Experiment, arm: Arm, repeat: int, prediction: predict.Prediction) -> None:
    with transaction.atomic():
        locked = Arm.objects.select_for_update().get(pk=arm.pk)
        if not any(r["repeat"] == repeat for r in locked.results):  # else taken meanwhile by a late runner
            locked.results = [*locked.results, result_of(exp, repeat, locked.attempts, prediction)]
            locked.save(update_fields=["results"])
    exp.changed()


def fail(exp: Experiment, arm: Arm, reason: str) -> None:
    arm.refresh_from_db()
    Arm.objects.filter(pk=arm.pk).update(
        status=ArmStatus.FAILED, error=reason, finished_at=timezone.now(), summary=measure.summarize(arm.results)
    )
    exp.record("arm_failed", None, {"arm": arm.name, "reason": reason})
    exp.changed()


# ---- 3. enough ----------------------------------------------------------------------------------


def rounds_done(exp: Experiment) -> int:
    counts = [len(a.results) for a in exp.arms.filter(status__lt=ArmStatus.SUCCEEDED)]
    return min(counts) if counts else 0


def narrow(rec: Recommendation, baseline_score: float | None) -> bool:
    """Narrow enough to stop: the answer is decided, or every interval
    against the baseline is within MIN_EFFECT of the baseline's score."""
    if rec.outcome in (Outcome.WINNER, Outcome.NONE_MET):
        return True
    if not baseline_score or not rec.versus_baseline:
        return False
    return all((d.high - d.low) / 2 <= MIN_EFFECT * abs(baseline_score) for d in rec.versus_baseline.values())


def done(exp: Experiment) -> bool:
    if not exp.arms.filter(status__lt=ArmStatus.SUCCEEDED).exists():
        return True
    rounds = rounds_done(exp)
    if rounds >= PREDICT_MAX_REPEATS:
        return True
    if rounds < max(exp.repeats, MIN_REPEATS):
        return False
    rec = runner.judge(exp)
    if rec is None:
        return True
    base = exp.arms.filter(name=rec.baseline).first() if rec.baseline else None
    score: float | None = None
    if base is not None:
        figures = runner.arm_figures(exp, base)
        values = figures.capacity if rec.basis == "capacity" else figures.goodput
        score = sum(values) / len(values) if values else None
    return narrow(rec, score)


def finish_arms(exp: Experiment) -> None:
    """Every arm still running has its repeats: summarized and succeeded;
    the experiment's repeats are the rounds it took."""
    rounds = rounds_done(exp)
    for arm in exp.arms.filter(status__lt=ArmStatus.SUCCEEDED):
        summary = measure.summarize(arm.results)
        Arm.objects.filter(pk=arm.pk).update(
            status=ArmStatus.SUCCEEDED, summary=summary, finished_at=timezone.now(), error=""
        )
        exp.record(
            "arm_succeeded",
            None,
            {
                "arm": arm.name,
                "predicted": True,
                "goodput": summary.get("goodput", {}).get("mean"),
                "output_throughput": summary.get("output_throughput", {}).get("mean"),
            },
        )
    if rounds and rounds != exp.repeats:
        Experiment.objects.filter(pk=exp.pk).update(repeats=rounds)
        exp.repeats = rounds
