"""``python manage.py demo``: the whole system on one machine.

Migrates, makes the admin user (password from CHUNKPILOT_ADMIN_PASSWORD, or
generated and printed), seeds profiles and pools, then starts the web server
(port CHUNKPILOT_PORT, default 8000), a Celery worker and beat, and three
reference workers on the tiny model, and prints where to log in. Ctrl-C
stops every process, then the embedded Redis.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane import demo, embedded
from controlplane.gateway import demo as gateway_demo
from controlplane.launcher import LaunchError, Supervisor


class Command(BaseCommand):
    help = "Run the whole system on this machine until Ctrl-C."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default=os.environ.get("CHUNKPILOT_HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("CHUNKPILOT_PORT", "8000")))
        parser.add_argument(
            "--gateway-port",
            type=int,
            default=int(os.environ.get("CHUNKPILOT_GATEWAY_PORT", gateway_demo.GATEWAY_PORT)),
        )
        parser.add_argument("--no-workers", action="store_true", help="control plane only")
        parser.add_argument(
            "--verbose",
            action="store_true",
            help="keep echoing every process's output after start-up (default: warnings and errors)",
        )
        parser.add_argument(
            "--model", type=Path, help="the workers' checkpoint (default: the tiny model, built on first use)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        data_dir = Path(settings.DATA_DIR)
        say = self.stdout.write
        embedded.lease_if_embedded()  # up before the processes it starts, down when it stops them
        say("Migrating the database…")
        call_command("migrate", interactive=False, verbosity=0)
        password = demo.ensure_admin(os.environ.get("CHUNKPILOT_ADMIN_PASSWORD"))
        ctx = demo.DemoContext(
            host=options["host"],
            port=options["port"],
            data_dir=data_dir,
            admin_password=password,
            gateway_port=options["gateway_port"],
        )

        if options["no_workers"]:
            pass
        elif not demo.worker_server_available():
            self.stderr.write(
                "workers.server is not installed in this checkout: starting the control plane without workers."
            )
        else:
            ctx.model_dir = options["model"] or data_dir / "tiny-model"
            if not options["model"] and not demo.tiny_model_ready(ctx.model_dir):
                say(f"Copying the tiny model to {ctx.model_dir}…")
                subprocess.run([demo.PYTHON, "-m", "workers", "make-tiny-model", str(ctx.model_dir)], check=True)
        demo.seed(ctx)

        supervisor = Supervisor(data_dir / "demo" / "logs")
        supervisor.install_signal_handlers()
        exited = None
        try:
            for spec in demo.processes(ctx):
                supervisor.start(spec)
            if not supervisor.stopping.is_set():
                self._banner(ctx, supervisor.log_dir, verbose=options["verbose"])
                supervisor.quiet = not options["verbose"]
                exited = supervisor.watch()
        except LaunchError as exc:
            if not supervisor.stopping.is_set():
                raise CommandError(str(exc)) from exc
        finally:
            say("Stopping…")
            supervisor.stop_all()
            if settings.EMBEDDED_REDIS:
                embedded.release(data_dir)
                embedded.stop(data_dir)  # even if a child was killed before it gave its lease back
            say("Stopped.")
        if exited is not None:
            raise CommandError(f"{exited} exited; everything was stopped. Logs: {supervisor.log_dir}")

    def _banner(self, ctx: demo.DemoContext, log_dir: Path, *, verbose: bool) -> None:
        lines = [
            "",
            "Chunkpilot is running.",
            f"  Web UI:    {ctx.url}/",
            f"  API docs:  {ctx.url}/api/docs/",
            f"  Gateway:   http://{ctx.host}:{ctx.gateway_port}/v1 (OpenAI API, models {demo.SIM_MODEL} and"
            f" {ctx.model_name}, key {ctx.client_key})",
            (
                f"  Fleet:     {sum(n for _, _, n in demo.DEMO_SIM_WORKERS)} simulated H200 workers"
                f" ({demo.SIM_MODEL}: step times from NVIDIA AIConfigurator's database, no real inference)"
                f" and {len(demo.DEMO_WORKERS)} reference workers (real inference on {ctx.model_name})"
                if ctx.model_dir
                else "  Fleet:     no workers"
            ),
            f"  Login:     {demo.ADMIN_USERNAME} / {ctx.admin_password}",
            (
                f"  Traffic:   long-tail mix at {demo.DEMO_GPU_TRAFFIC_RATE:g} req/s to {demo.SIM_MODEL} and"
                f" {demo.DEMO_TRAFFIC_RATE:g} req/s to {ctx.model_name} through the gateway"
                " (CHUNKPILOT_DEMO_GPU_RATE / CHUNKPILOT_DEMO_RATE; 0 turns one off)"
                if ctx.model_dir
                else "  Traffic:   none"
            ),
            f"  Logs:      {log_dir}",
            "  Ctrl-C stops everything."
            + ("" if verbose else " From here on the console shows warnings and errors only (--verbose: all)."),
            "",
        ]
        self.stdout.write(self.style.SUCCESS("\n".join(lines)))
