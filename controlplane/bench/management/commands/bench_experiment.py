"""``python manage.py bench_experiment``: does an experiment measure the
engine, or its own machinery?

A benchmark, not a test: it prints figures and ratios, it asserts nothing.
On one reference worker (the tiny model), one after the other, on the same
workload (a loadgen scenario's, seeded) and the same profile:

1. **bare**: the worker alone, no control plane running, driven by
   ``python -m workers replay``'s own code: warm-up, then the measured
   replay;
2. **experiment**: the full control plane (web server, Celery worker with
   beat: scrapes, health sweeps, the runner) with the worker enrolled in a
   lab pool, and an experiment whose one arm is that profile, with the same
   warm-up, duration and seed.

3. **workers bench**: ``python -m workers bench --workload FILE --profile
   JSON`` itself on the same workload (its spec written to a file), the
   same profile, warm-up, duration and seed: the engine in one process,
   no HTTP, no control plane.

It prints the experiment's throughput and stall P99 against ``workers
bench``'s and their ratios (the issue's bounds: throughput within 10%, stall
P99 within 20%; otherwise the experiment measures its own machinery), the
same against the bare replay, and the control plane's overhead as the share
of the bare throughput the experiment lost (bound: 5%). ``--grid default`` then runs the default grid (a monolithic
baseline, chunk caps 256 to 2048) the same way and prints the curve.

It makes throwaway rows (named ``bench-exp-<id>``, deleted afterwards) in
the configured database, on a Celery queue and a Redis namespace of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

from controlplane.experiments.models import Experiment, Workload, default_arms
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
from workers import replay
from workers.loadgen import parse_slos

PROFILE = {
    "prefill_mode": "chunked",
    "max_num_batched_tokens": 512,
    "long_prefill_token_threshold": 256,
    "max_num_seqs": 32,
}


class Command(BaseCommand):
    help = "An experiment's figures for one arm against a bare replay of the same workload and profile."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--model", type=Path, default=Path("var/tiny-model"), help="checkpoint directory")
        parser.add_argument("--scenario", default="long-tail")
        parser.add_argument("--rate", type=float, default=1.0, help="requests per second")
        parser.add_argument("--duration", type=float, default=30.0, help="measured seconds per run")
        parser.add_argument("--warmup", type=float, default=5.0)
        parser.add_argument("--max-model-len", type=int, default=2048)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument(
            "--grid",
            choices=("none", "default"),
            default="none",
            help="also run the default grid as an experiment and print its curve",
        )
        parser.add_argument("--repeats", type=int, default=1, help="repeats per arm of the grid")
        parser.add_argument(
            "--threads",
            type=int,
            default=1,
            help="torch threads of every engine (OMP_NUM_THREADS of each child; 0: their default). "
            "On a loaded machine a multi-threaded step waits on its slowest thread, by an "
            "amount that changes minute to minute; one thread keeps the runs comparable",
        )
        parser.add_argument(
            "--worker-cpus",
            default="",
            help="CPUs (taskset's list, e.g. '1') every engine runs on, in all three runs; this "
            "command, the control plane's processes and the replay client get the other CPUs, as "
            "on a fleet where the control plane is not on the GPU host. Default: all share every CPU",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        tag = f"bench-exp-{uuid.uuid4().hex[:6]}"
        self.worker_cpus = _cpu_list(options["worker_cpus"])
        if self.worker_cpus:
            others = set(os.sched_getaffinity(0)) - self.worker_cpus
            if not others:
                raise CommandError(f"--worker-cpus {options['worker_cpus']} leaves no CPU for the control plane")
            os.sched_setaffinity(0, others)  # every child but the engines inherits it
            self.stdout.write(f"engines on CPUs {sorted(self.worker_cpus)}, the rest on {sorted(others)}")
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
            f"workload: {options['scenario']} at {spec.rate_per_second:.2f} req/s, burstiness "
            f"{spec.burstiness:.2f}, prompt P50/P99 {spec.prompt_tokens.quantile(0.5)}/"
            f"{spec.prompt_tokens.quantile(0.99)} tokens; profile {PROFILE}"
        )
        try:
            with tempfile.TemporaryDirectory(prefix=tag) as tmp:
                bare = self._bare(Path(tmp), spec, options)
                exp = self._experiment(
                    Path(tmp), tag, workload, options, [{"name": "arm", "fields": PROFILE}], repeats=1
                )
                arm = exp.arms.get()
                bench = self._workers_bench(Path(tmp), workload, options)
                self._compare(bare, arm.results[0]["figures"], bench)
                if options["grid"] == "default":
                    grid = self._experiment(
                        Path(tmp),
                        tag + "-grid",
                        workload,
                        options,
                        default_arms(options["max_model_len"]),
                        repeats=options["repeats"],
                    )
                    self._curve(grid)
        finally:
            self._delete(tag)

    # ---- 1. the worker alone ---------------------------------------------------------------

    def _bare(self, tmp: Path, spec: replay.WorkloadSpec, options: dict[str, Any]) -> dict[str, Any]:
        port = free_port()
        log = tmp / "bare-worker.log"
        argv = worker_argv(
            options["model"],
            port,
            max_model_len=options["max_model_len"],
            device="cpu",
            log_level="warning",
            profile=PROFILE,
        )
        url = f"http://127.0.0.1:{port}"
        with child(self._on_worker_cpus(argv), log, {**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
            wait_http(f"{url}/v1/models", proc, log, timeout=240)
            slos = parse_slos(None)
            if options["warmup"] > 0:
                asyncio.run(
                    replay.run(
                        url,
                        spec,
                        duration_seconds=options["warmup"],
                        seed=1000,
                        model_dir=str(options["model"]),
                        slos=slos,
                    )
                )
            started = time.monotonic()
            summary = asyncio.run(
                replay.run(
                    url, spec, duration_seconds=options["duration"], seed=0, model_dir=str(options["model"]), slos=slos
                )
            )
            self.stdout.write(f"bare replay: {summary['num_requests']} requests in {time.monotonic() - started:.1f} s")
        return summary

    # ---- 3. python -m workers bench on the same workload ---------------------------------------

    def _workers_bench(self, tmp: Path, workload: Workload, options: dict[str, Any]) -> dict[str, Any] | None:
        """``python -m workers bench`` on the workload and PROFILE; its
        figures for the profile, or None (with its output) when it failed."""
        spec_file, out = tmp / "workload.json", tmp / "workers-bench.json"
        spec_file.write_text(json.dumps({"spec": workload.spec}))
        slos = parse_slos(None)
        argv = [
            sys.executable,
            "-m",
            "workers",
            "bench",
            "--model",
            str(options["model"]),
            "--workload",
            str(spec_file),
            "--profile",
            json.dumps(PROFILE),
            "--scenarios",
            "mixed",
            "--vllm",
            "off",
            "--duration",
            str(options["duration"]),
            "--warmup",
            str(options["warmup"]),
            "--seed",
            "0",
            "--max-model-len",
            str(options["max_model_len"]),
            "--slo-ttft",
            str(slos["ttft"] / 1000),
            "--slo-tpot",
            str(slos["tpot"] / 1000),
            "--json",
            str(out),
        ]
        started = time.monotonic()
        done = subprocess.run(self._on_worker_cpus(argv), capture_output=True, text=True, check=False)
        if done.returncode != 0 or not out.exists():
            self.stdout.write(f"workers bench failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
            return None
        figures: dict[str, Any] = json.loads(out.read_text())["mixed"]["profile"]
        self.stdout.write(f"workers bench: {figures['requests']:.0f} requests in {time.monotonic() - started:.1f} s")
        return figures

    def _on_worker_cpus(self, argv: list[str]) -> list[str]:
        """An engine's command line, pinned to ``--worker-cpus`` when given."""
        if not self.worker_cpus:
            return argv
        return ["taskset", "-c", ",".join(str(c) for c in sorted(self.worker_cpus)), *argv]

    # ---- 2. the same through an experiment --------------------------------------------------

    def _child_env(self, tag: str, options: dict[str, Any]) -> dict[str, str]:
        db = connection.settings_dict
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "CELERY_QUEUE": tag,
            "CHANNELS_PREFIX": tag,
            "REDIS_URL": settings.REDIS_URL,
            "EXPERIMENT_TOKENIZER_DIR": str(options["model"]),
        }
        if db["ENGINE"].endswith("postgresql"):
            auth = db["USER"] + (f":{db['PASSWORD']}" if db.get("PASSWORD") else "")
            env["DATABASE_URL"] = f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
        return env

    def _experiment(
        self,
        tmp: Path,
        tag: str,
        workload: Workload,
        options: dict[str, Any],
        arms: list[dict[str, Any]],
        *,
        repeats: int,
    ) -> Experiment:
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
            worker = stack.enter_context(
                child(
                    self._on_worker_cpus(
                        worker_argv(
                            options["model"],
                            port,
                            max_model_len=options["max_model_len"],
                            device="cpu",
                            log_level="warning",
                            enrollment=enrollment,
                        )
                    ),
                    tmp / "worker.log",
                    env,
                )
            )
            wait_until(
                lambda: Worker.objects.filter(name=name, state=Worker.State.READY).exists(),
                timeout=240,
                what="the worker ready",
                detail=lambda: (tmp / "worker.log").read_text()[-2000:],
            )
            assert worker.poll() is None
            exp = Experiment.create(
                name=tag,
                workload=workload,
                workers=[Worker.objects.get(name=name)],
                arms=arms,
                duration_seconds=options["duration"],
                warmup_seconds=options["warmup"],
                repeats=repeats,
            )
            started = time.monotonic()
            wait_until(
                lambda: Experiment.objects.get(pk=exp.pk).is_finished,
                timeout=3600,
                interval=1.0,
                what="the experiment to finish",
                detail=lambda: (tmp / "celery.log").read_text()[-3000:],
            )
            self.stdout.write(f"experiment {exp.pk}: {exp.arms.count()} arm(s) in {time.monotonic() - started:.0f} s")
        return Experiment.objects.get(pk=exp.pk)

    # ---- figures -------------------------------------------------------------------------------

    def _compare(self, bare: dict[str, Any], arm: dict[str, Any], bench: dict[str, Any] | None) -> None:
        bare_tput, exp_tput = bare["output_throughput"], arm["output_throughput"]
        bare_stall = (bare["max_gap_ms"]["p99"] or 0) / 1000
        exp_stall = arm["client_stall_p99"] or 0.0
        if bench is not None:
            bench_tput, bench_stall = bench["output_throughput_tps"] or 0.0, bench["stall_p99_seconds"] or 0.0
            tput_ratio = exp_tput / bench_tput if bench_tput else float("nan")
            stall_ratio = exp_stall / bench_stall if bench_stall else float("nan")
            self.stdout.write(f"{'':28}{'workers bench':>14}{'experiment':>14}{'ratio':>8}")
            self.stdout.write(
                f"{'output throughput (tok/s)':28}{bench_tput:14.1f}{exp_tput:14.1f}{tput_ratio:8.3f}"
                f"   (bound: within 10%: {'met' if abs(tput_ratio - 1) <= 0.10 else 'NOT met'})"
            )
            self.stdout.write(
                f"{'stall P99 (ms)':28}{bench_stall * 1000:14.1f}{exp_stall * 1000:14.1f}"
                f"{stall_ratio:8.3f}   (bound: within 20%: "
                f"{'met' if abs(stall_ratio - 1) <= 0.20 else 'NOT met'})"
            )
            self.stdout.write(
                f"{'TTFT P99 (ms)':28}{(bench['ttft_p99_seconds'] or 0) * 1000:14.1f}"
                f"{(arm['client_ttft_p99'] or 0) * 1000:14.1f}"
            )
        self.stdout.write(f"{'':28}{'bare replay':>14}{'experiment':>14}{'ratio':>8}")
        self.stdout.write(
            f"{'output throughput (tok/s)':28}{bare_tput:14.1f}{exp_tput:14.1f}"
            f"{exp_tput / bare_tput if bare_tput else float('nan'):8.3f}   (bound: within 10%)"
        )
        self.stdout.write(
            f"{'stall P99 (ms)':28}{bare_stall * 1000:14.1f}{exp_stall * 1000:14.1f}"
            f"{exp_stall / bare_stall if bare_stall else float('nan'):8.3f}   (bound: within 20%)"
        )
        self.stdout.write(
            f"{'TTFT P99 (ms)':28}{bare['ttft_ms']['p99'] or 0:14.1f}{(arm['client_ttft_p99'] or 0) * 1000:14.1f}"
        )
        overhead = 1 - exp_tput / bare_tput if bare_tput else float("nan")
        self.stdout.write(f"control-plane overhead: {overhead * 100:.1f}% of the bare throughput (bound: 5%)")

    def _curve(self, exp: Experiment) -> None:
        self.stdout.write(f"default grid, experiment {exp.pk} ({exp.phase_label}):")
        self.stdout.write(f"{'arm':14}{'tok/s':>10}{'goodput':>10}{'TTFT P99':>11}{'stall P99':>11}{'mem peak MB':>13}")
        for arm in exp.arms.order_by("index"):
            s = arm.summary or {}

            def mean(key: str, s: dict[str, Any] = s) -> float:
                value = (s.get(key) or {}).get("mean")
                return float("nan") if value is None else float(value)

            self.stdout.write(
                f"{arm.name:14}{mean('output_throughput'):10.1f}{mean('goodput'):10.2f}"
                f"{mean('client_ttft_p99') * 1000:9.0f}ms{mean('client_stall_p99') * 1000:9.0f}ms"
                f"{mean('memory_peak_bytes') / 1e6:13.1f}" + (f"  {arm.status_label}: {arm.error}" if arm.error else "")
            )
        self.stdout.write("recommendation: " + "; ".join(exp.recommendation.get("reasons", [])))
        spreads = [((a.summary or {}).get("output_throughput") or {}).get("half_range") for a in exp.arms.all()]
        if any(spreads):
            self.stdout.write(
                f"throughput spread over repeats: median ±{statistics.median(s for s in spreads if s):.1f}"
            )

    def _delete(self, tag: str) -> None:
        profiles = [tag, f"{tag}-grid"]
        for exp in Experiment.objects.filter(name__startswith=tag):
            if exp.profile is not None:
                profiles.append(exp.profile.name)
            exp.delete()
        Workload.objects.filter(name=tag).delete()
        Worker.objects.filter(name__startswith=tag).delete()
        EnrollmentToken.objects.filter(name__startswith=tag).delete()
        Pool.objects.filter(name__startswith=tag).delete()
        Profile.objects.filter(name__in=profiles).delete()


def _cpu_list(text: str) -> set[int]:
    """taskset's CPU list ("1", "0,2", "2-3") as a set; empty for none."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, _, high = part.partition("-")
        try:
            cpus.update(range(int(low), int(high or low) + 1))
        except ValueError:
            raise CommandError(f"--worker-cpus: {part!r} is not a CPU number or range") from None
    return cpus
