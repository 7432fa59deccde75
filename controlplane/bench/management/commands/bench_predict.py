"""``python manage.py bench_predict``: how close is a predicted sweep to the
same sweep measured?

A benchmark, not a test: it prints figures and ratios, it asserts nothing.
On one reference worker on the tiny model (the demo's lab worker), enrolled
in a lab pool of a full control plane (web server, Celery worker with beat):

1. a sweep in **predict** mode (a monolithic baseline and chunk caps, the
   default grid): every arm in virtual time on the step-time table fitted
   to the reference engine on this machine (fitted by the task when the
   data dir has none: about 100 s, once), repeated until the intervals are
   narrow;
2. **Verify on lab workers**: the prediction's best arms and its baseline,
   measured on that worker over the same workload, seeds and arm lengths.

It prints, per verified arm, predicted against measured (goodput, output
throughput, TTFT P99, stall P99) with measured ÷ predicted, both
recommendations, and how long each half took. The rows it makes are
named ``bench-pred-<id>`` and deleted afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from django.core.management.base import CommandParser

from controlplane.bench.management.commands.bench_experiment import PROFILE, _cpu_list
from controlplane.bench.management.commands.bench_experiment import Command as ExperimentBench
from controlplane.experiments.models import COMPARED_FIGURES, Experiment, Mode, Workload, default_arms
from controlplane.fleet.models import EnrollmentToken, Pool, Worker
from controlplane.launcher import (
    Enrollment,
    celery_worker_argv,
    child,
    free_port,
    wait_http,
    wait_until,
    web_argv,
    worker_argv,
)
from controlplane.profiles.models import Profile

LABELS = {
    "goodput": ("goodput (req/s)", 1.0, ".3f"),
    "output_throughput": ("throughput (tok/s)", 1.0, ".1f"),
    "client_ttft_p99": ("TTFT P99 (ms)", 1000.0, ".0f"),
    "client_stall_p99": ("stall P99 (ms)", 1000.0, ".0f"),
    "client_tpot_p99": ("TPOT P99 (ms)", 1000.0, ".1f"),
}


class Command(ExperimentBench):
    help = "A predicted sweep on a reference lab worker, then verified on it: predicted against measured per arm."

    def add_arguments(self, parser: CommandParser) -> None:
        super().add_arguments(parser)
        parser.set_defaults(duration=20.0, repeats=3)
        parser.add_argument(
            "--chunk-sizes", default="256,512,1024", help="the grid's chunk caps, beside a monolithic baseline"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # SIGTERM unwinds like Ctrl-C: the processes started and the rows made go with the run.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
        tag = f"bench-pred-{uuid.uuid4().hex[:6]}"
        self.worker_cpus = _cpu_list(options["worker_cpus"])
        if options["threads"] > 0:
            os.environ["OMP_NUM_THREADS"] = str(options["threads"])  # every child process inherits it
        workload = Workload.from_scenario(
            name=tag,
            scenario=options["scenario"],
            rate=options["rate"],
            duration_seconds=max(60.0, options["duration"]),
            seed=options["seed"],
        )
        spec = workload.workload_spec()
        self.stdout.write(
            f"workload: {options['scenario']} at {spec.rate_per_second:.2f} req/s, prompt P50/P99 "
            f"{spec.prompt_tokens.quantile(0.5)}/{spec.prompt_tokens.quantile(0.99)} tokens; arms of "
            f"{options['duration']:g} s (warm-up {options['warmup']:g} s)"
        )
        sizes = tuple(int(c) for c in options["chunk_sizes"].split(","))
        arms = default_arms(options["max_model_len"], sizes)
        try:
            with tempfile.TemporaryDirectory(prefix=tag) as tmp:
                self._run(Path(tmp), tag, workload, options, arms)
        finally:
            self._delete(tag)

    def _run(
        self, tmp: Path, tag: str, workload: Workload, options: dict[str, Any], arms: list[dict[str, Any]]
    ) -> None:
        env = self._child_env(tag, options)
        profile = Profile.objects.create(name=tag)
        pool = Pool.objects.create(name=tag)
        pool.set_desired_revision(profile.add_revision(PROFILE))
        _, token = EnrollmentToken.issue(tag, pool=pool, max_uses=1)
        web_port, port = free_port(), free_port()
        web_url = f"http://127.0.0.1:{web_port}"
        with contextlib.ExitStack() as stack:
            web = stack.enter_context(child(web_argv(web_port, log_level="warning"), tmp / "web.log", env))
            wait_http(f"{web_url}/login/", web, tmp / "web.log")
            celery_argv = celery_worker_argv(
                f"{tag}@%h", queue=tag, pool="solo", log_level="WARNING", beat_schedule=tmp / f"{tag}-beat"
            )
            stack.enter_context(child(celery_argv, tmp / "celery.log", env))
            name = f"{tag}-w"
            enrollment = Enrollment(
                web_url, token, name, tmp / f"{name}.state", advertise_url=f"http://127.0.0.1:{port}"
            )
            argv = worker_argv(
                options["model"],
                port,
                max_model_len=options["max_model_len"],
                device="cpu",
                log_level="warning",
                enrollment=enrollment,
            )
            stack.enter_context(child(self._on_worker_cpus(argv), tmp / "worker.log", env))
            wait_until(
                lambda: Worker.objects.filter(name=name, state=Worker.State.READY).exists(),
                timeout=240,
                what="the worker ready",
                detail=lambda: (tmp / "worker.log").read_text()[-2000:],
            )
            predicted = Experiment.create(
                name=tag,
                workload=workload,
                workers=[Worker.objects.get(name=name)],
                arms=arms,
                duration_seconds=options["duration"],
                warmup_seconds=options["warmup"],
                repeats=options["repeats"],
                mode=Mode.PREDICT,
            )
            predicted = self._wait(predicted, tmp)
            self.stdout.write(
                f"prediction {predicted.pk}: {predicted.phase_label}, {predicted.arms.count()} arms x "
                f"{predicted.repeats} repeats, {predicted.predicted_label}, in {self.took:.0f} s "
                f"(a fit included when the data dir had no table)"
            )
            self.stdout.write("predicted recommendation: " + "; ".join(predicted.recommendation.get("reasons", [])))
            measured = self._wait(predicted.verify(None, repeats=options["repeats"]), tmp)
            self.stdout.write(
                f"verification {measured.pk}: {measured.phase_label}, {measured.arms.count()} arms x "
                f"{measured.repeats} repeats on {name}, in {self.took:.0f} s"
            )
            self.stdout.write("measured recommendation: " + "; ".join(measured.recommendation.get("reasons", [])))
            self._table(measured)

    def _wait(self, exp: Experiment, tmp: Path) -> Experiment:
        started = time.monotonic()
        wait_until(
            lambda: Experiment.objects.get(pk=exp.pk).is_finished,
            timeout=3600,
            interval=1.0,
            what=f"experiment {exp.pk} to finish",
            detail=lambda: (tmp / "celery.log").read_text()[-3000:],
        )
        self.took = time.monotonic() - started
        return Experiment.objects.get(pk=exp.pk)

    def _table(self, measured: Experiment) -> None:
        """Markdown, for README: one row per arm, predicted | measured | ratio per figure."""
        head = ["arm"]
        for key in COMPARED_FIGURES:
            label = LABELS[key][0]
            head += [f"{label} predicted", "measured", "ratio"]
        self.stdout.write("| " + " | ".join(head) + " |")
        self.stdout.write("|" + "---|" * len(head))
        for row in measured.predicted_against_measured():
            cells = [row["arm"]]
            for key in COMPARED_FIGURES:
                _, scale, fmt = LABELS[key]
                f = row["figures"][key]
                for value in (f["predicted"], f["measured"]):
                    cells.append("—" if value is None else format(value * scale, fmt))
                cells.append("—" if f["ratio"] is None else f"{f['ratio']:.2f}")
            self.stdout.write("| " + " | ".join(cells) + " |")

    def _delete(self, tag: str) -> None:
        for verification in Experiment.objects.filter(verifies__name__startswith=tag):
            profile = verification.profile
            verification.delete()
            if profile is not None:
                profile.delete()
        super()._delete(tag)
