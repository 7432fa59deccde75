"""``python manage.py validate_decisions``: the advisor's verdicts against
what switching to chunked prefill actually does (docs/validation.md).

Each scenario of the panel runs twice on the same workers, on its baseline
profile and on the tuned chunked profile, with the same seeded requests;
the clients' figures say whether chunking paid, the advisor judges the
observed run from its live figures, and the table says whether they agree.

By default it starts reference workers on the shipped tiny model, one set
per run. ``--urls`` takes workers started elsewhere instead (GPU hosts,
simulated workers): ``{"monolithic": [...], "chunked-unsplit": [...],
"chunked": [...]}``, each set serving that profile of the panel
(``controlplane/advisor/validation/scenarios.py:profiles``).

It makes throwaway rows (a pool, a profile and worker rows named
``validate-<scenario>-<id>``, their snapshots and request-log rows) in the
configured database, deleted after each scenario.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.advisor.validation import experiment as ex
from controlplane.advisor.validation import harness as h
from controlplane.advisor.validation.outcome import Objectives
from controlplane.advisor.validation.scenarios import select


def table(rows: list[h.Row], objectives: Objectives) -> str:
    """The markdown table: scenario, advisor verdict, A/B outcome, agree?"""
    lines = [
        "| scenario | advisor verdict | A/B outcome | agree? |",
        "|---|---|---|---|",
    ]
    for r in rows:
        outcome = ("pays" if r.judgement.pays else "does not pay") + f": {r.judgement.reason}"
        advisor = r.advisor or "no report"
        agree = "yes" if r.agree else "**no**"
        if not r.agree:
            agree += f" (advisor: {'; '.join(r.advisor_reasons)[:300] or 'no reason given'})"
        lines.append(f"| {r.scenario.name} | {advisor} | {outcome} | {agree} |")
    return "\n".join(lines)


def experiment_table(rows: list[ex.ExperimentRow]) -> str:
    """The markdown table: scenario, recommendation and why, the rerun's figures, confirmed?"""
    lines = [
        "| scenario | recommendation | its reason | rerun | confirmed? |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        rec = r.recommendation
        said = rec.outcome.label + (f": {rec.winner}" if rec.winner else "")
        rerun = "; ".join(
            f"{name}: goodput {', '.join(f'{o.goodput:.2f}' for o in runs)} req/s, stall P99 "
            + ", ".join("n/a" if o.stall_p99_seconds is None else f"{o.stall_p99_seconds * 1000:.0f}" for o in runs)
            + " ms, "
            + ", ".join(f"{o.output_tokens_per_second:.0f}" for o in runs)
            + f" tok/s ({', '.join(str(o.num_requests) for o in runs)} requests)"
            for name, runs in r.rerun.items()
        )
        confirmed = {True: "yes", False: "**no**", None: "nothing to confirm"}[r.confirmation.confirmed]
        lines.append(
            f"| {r.scenario.name} | {said} | {'; '.join(rec.reasons)} | {rerun or 'none'} | "
            f"{confirmed}: {r.confirmation.reason} |"
        )
    return "\n".join(lines)


class Command(BaseCommand):
    help = "Run the validation panel: the advisor's verdicts against A/B runs of the same seeded traffic."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--scenarios", nargs="*", default=[], help="scenario names (default: the whole panel)")
        parser.add_argument("--model", type=Path, default=h.TINY_MODEL, help="checkpoint directory the workers serve")
        parser.add_argument("--max-model-len", type=int, default=2048)
        parser.add_argument("--num-workers", type=int, default=1, help="workers per run (started here)")
        parser.add_argument("--engine", default=None, help="the workers' engine (default: reference)")
        parser.add_argument("--device", default="cpu")
        parser.add_argument("--threads", type=int, default=1, help="torch threads per started worker (0: default)")
        parser.add_argument(
            "--urls", default="", help='workers started elsewhere, as JSON {"monolithic": [...], "chunked": [...], ...}'
        )
        parser.add_argument("--ttft-ms", type=float, default=2000.0, help="TTFT objective (goodput)")
        parser.add_argument("--tbt-ms", type=float, default=100.0, help="TBT objective: the stall P99 to meet")
        parser.add_argument("--tpot-ms", type=float, default=100.0, help="TPOT objective (goodput)")
        parser.add_argument(
            "--side-by-side",
            action="store_true",
            help="run both arms of a scenario at once on two worker sets, so a shared host's load hits both alike",
        )
        parser.add_argument(
            "--nice",
            type=int,
            default=0,
            help="niceness of the started workers and of this command (the clients); below 0 (root only), a "
            "shared host's other work waits first, so its load adds less noise to the token gaps",
        )
        parser.add_argument("--budget", type=int, default=256, help="the tuned chunked profile's token budget")
        parser.add_argument("--chunk-cap", type=int, default=128, help="the tuned chunked profile's chunk cap")
        parser.add_argument("--rate-scale", type=float, default=1.0, help="multiply every scenario's rate")
        parser.add_argument("--duration-scale", type=float, default=1.0, help="multiply every scenario's duration")
        parser.add_argument(
            "--advisor-setting",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help="a setting the advisor reads (as an operator would set it), e.g. ADVISOR_MIN_REQUESTS=50",
        )
        parser.add_argument(
            "--experiment",
            default="",
            metavar="SCENARIO[,SCENARIO]",
            help="instead of the panel: the experiments' recommendation on a sweep of arms for these scenarios, "
            "against a rerun of the recommended arm on fresh repeats",
        )
        parser.add_argument(
            "--caps", default="128,512", help="--experiment: the chunked arms' chunk caps (budget max(cap, 256))"
        )
        parser.add_argument("--repeats", type=int, default=2, help="--experiment: paired repeats of the sweep")
        parser.add_argument("--rerun-repeats", type=int, default=2, help="--experiment: repeats of the rerun")
        parser.add_argument("--json", type=Path, help="write every row's figures and the advisor's report here")

    def handle(self, *args: Any, **options: Any) -> None:
        logging.getLogger("httpx").setLevel(logging.WARNING)
        # Stopped with SIGTERM, the started workers (each in a session of its own) are stopped too.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            scenarios = select(options["scenarios"])
            if options["experiment"]:
                select([n.strip() for n in options["experiment"].split(",") if n.strip()])
                if not all(c.strip().isdigit() and int(c) > 0 for c in options["caps"].split(",")):
                    raise ValueError(f"--caps {options['caps']!r}: chunk caps are positive whole numbers, e.g. 128,512")
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        objectives = Objectives(options["ttft_ms"] / 1000, options["tbt_ms"] / 1000, options["tpot_ms"] / 1000)
        settings: dict[str, Any] = {}
        for item in options["advisor_setting"]:
            name, sep, value = item.partition("=")
            if not sep or not name:
                raise CommandError(f"--advisor-setting {item!r}: use NAME=VALUE")
            settings[name] = value
        if options["nice"]:
            os.nice(options["nice"])
        command = "python manage.py validate_decisions " + shlex.join(sys.argv[2:])
        started = datetime.now(UTC)
        with tempfile.TemporaryDirectory(prefix="validate-") as tmp:
            workers: h.WorkerSet
            if options["urls"]:
                try:
                    urls = json.loads(options["urls"])
                except ValueError as exc:
                    raise CommandError(f"--urls: not JSON: {exc}") from exc
                workers = h.RunningWorkers(urls)
            else:
                workers = h.LaunchedWorkers(
                    options["model"],
                    Path(tmp),
                    options["max_model_len"],
                    num_workers=options["num_workers"],
                    engine=options["engine"],
                    device=options["device"],
                    threads=options["threads"],
                    nice=options["nice"],
                )
            harness = h.Harness(
                workers,
                objectives,
                options["max_model_len"],
                model_dir=options["model"],
                budget=options["budget"],
                chunk_cap=options["chunk_cap"],
                rate_scale=options["rate_scale"],
                duration_scale=options["duration_scale"],
                side_by_side=options["side_by_side"],
                advisor_settings=settings,
                say=lambda line: self.stdout.write(line),
            )
            if options["experiment"]:
                self._experiment(harness, options, command, started)
                return
            rows = []
            for scenario in scenarios:
                self.stdout.write(f"{scenario.name}: {scenario.what}")
                row = harness.run(scenario)
                self.stdout.write(
                    f"  outcome: {'pays' if row.judgement.pays else 'does not pay'} ({row.judgement.reason}); "
                    f"advisor: {row.advisor}; agree: {'yes' if row.agree else 'NO'}"
                )
                rows.append(row)
        self.stdout.write("")
        self.stdout.write(f"Command: `{command}`, run {started:%Y-%m-%d %H:%M} UTC.")
        self.stdout.write(
            f"Objectives: TTFT {options['ttft_ms']:g} ms, TBT (stall P99) {options['tbt_ms']:g} ms, "
            f"TPOT {options['tpot_ms']:g} ms; tuned chunked profile: budget {options['budget']}, chunk cap "
            f"{options['chunk_cap']}."
        )
        self.stdout.write("")
        self.stdout.write(table(rows, objectives))
        agreed = sum(r.agree for r in rows)
        self.stdout.write(f"\n{agreed} of {len(rows)} rows agree.")
        if options["json"]:
            options["json"].write_text(
                json.dumps(
                    {
                        "command": command,
                        "started": started.isoformat(),
                        "objectives": objectives.to_json(),
                        "rows": [r.to_json() for r in rows],
                    },
                    indent=1,
                    default=str,
                )
            )

    def _experiment(self, harness: h.Harness, options: dict[str, Any], command: str, started: datetime) -> None:
        """The experiments' recommendation on each scenario, against a rerun of the recommended arm."""
        scenarios = select([n.strip() for n in options["experiment"].split(",") if n.strip()])
        arms = ex.arms(options["max_model_len"], [int(c) for c in options["caps"].split(",")])
        experiment = ex.Experiment(harness, arms, repeats=options["repeats"], rerun_repeats=options["rerun_repeats"])
        rows = []
        for scenario in scenarios:
            self.stdout.write(f"{scenario.name}: {scenario.what}")
            row = experiment.run(scenario)
            self.stdout.write(f"  {row.recommendation.outcome.label}; confirmed: {row.confirmation.confirmed}")
            rows.append(row)
        self.stdout.write("")
        self.stdout.write(f"Command: `{command}`, run {started:%Y-%m-%d %H:%M} UTC.")
        self.stdout.write(
            f"Arms: {', '.join(arms)}; {options['repeats']} paired repeats, rerun {options['rerun_repeats']}."
        )
        self.stdout.write("")
        self.stdout.write(experiment_table(rows))
        if options["json"]:
            options["json"].write_text(
                json.dumps(
                    {"command": command, "started": started.isoformat(), "rows": [r.to_json() for r in rows]},
                    indent=1,
                    default=str,
                )
            )
