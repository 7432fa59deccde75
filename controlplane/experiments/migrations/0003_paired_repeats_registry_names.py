"""Paired repeats (default 3) and a named baseline arm; results stored
under the figure registry's names (issue 28): the replay client's timings
are ``client_*``, the workers' take the registry's plain names. Stored
results, summaries and ramp points are renamed in place; going back
renames them back."""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

# The order matters: the client's first, since the workers' figures take the names the client's had.
RENAMED = (
    ("ttft_p99", "client_ttft_p99"),
    ("stall_p99", "client_stall_p99"),
    ("tbt_p99", "client_itl_p99"),
    ("tpot_p99", "client_tpot_p99"),
    ("worker_ttft_p99", "ttft_p99"),
    ("worker_tbt_p99", "itl_p99"),
)
RAMP_RENAMED = (("ttft_p99", "client_ttft_p99"), ("tpot_p99", "client_tpot_p99"))


def _rename(data: dict[str, Any], pairs: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    out = dict(data)
    for old, new in pairs:
        if old in out:
            out[new] = out.pop(old)
    return out


def _reverse(pairs: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    return tuple((new, old) for old, new in reversed(pairs))


def _migrate(apps: Any, figures: tuple[tuple[str, str], ...], ramp: tuple[tuple[str, str], ...], old_key: str) -> None:
    Arm = apps.get_model("experiments", "Arm")
    for arm in Arm.objects.all().iterator():
        results = [
            {**r, "figures": _rename(r["figures"], figures)} if old_key in (r.get("figures") or {}) else r
            for r in arm.results or []
        ]
        summary = _rename(arm.summary or {}, figures) if old_key in (arm.summary or {}) else arm.summary
        points = [_rename(p, ramp) for p in arm.ramp or []]
        if (results, summary, points) != (arm.results, arm.summary, arm.ramp):
            arm.results, arm.summary, arm.ramp = results, summary, points
            arm.save(update_fields=["results", "summary", "ramp"])


def forward(apps: Any, schema_editor: Any) -> None:
    _migrate(apps, RENAMED, RAMP_RENAMED, "stall_p99")


def backward(apps: Any, schema_editor: Any) -> None:
    _migrate(apps, _reverse(RENAMED), _reverse(RAMP_RENAMED), "client_stall_p99")


class Migration(migrations.Migration):
    dependencies = [("experiments", "0002_capacity_ramp")]

    operations = [
        migrations.AlterField(
            model_name="experiment",
            name="repeats",
            field=models.PositiveIntegerField(
                default=3, help_text="paired repeats: repeat r of every arm replays the same requests"
            ),
        ),
        migrations.AddField(
            model_name="experiment",
            name="baseline",
            field=models.CharField(
                blank=True,
                max_length=100,
                help_text="the arm every other is set beside; by default the pools' current profile, named baseline",
            ),
        ),
        migrations.RunPython(forward, backward),
    ]
