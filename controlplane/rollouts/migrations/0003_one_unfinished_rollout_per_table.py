from typing import Any

from django.db import migrations, models
from django.utils import timezone

ABORTED = 5  # evaluator.Phase.ABORTED, frozen as this migration knows it


def end_duplicates(apps: Any, schema_editor: Any) -> None:
    """Before the constraint: a table that the old check-then-insert race left
    with several unfinished rollouts keeps its oldest; the others are ended as
    aborted, with the reason on the row, so the constraint can be created."""
    Rollout = apps.get_model("rollouts", "Rollout")
    kept: set[int] = set()
    now = timezone.now()
    for rollout in Rollout.objects.filter(phase__lt=ABORTED).order_by("created", "id"):
        if rollout.routing_table_id in kept:
            Rollout.objects.filter(pk=rollout.pk).update(
                phase=ABORTED,
                finished_at=now,
                abort_reason="ended by migration: a second unfinished rollout on the same routing table",
            )
        else:
            kept.add(rollout.routing_table_id)


class Migration(migrations.Migration):
    dependencies = [
        ("rollouts", "0002_analysis_template_sample_wait_seconds"),
    ]

    operations = [
        migrations.RunPython(end_duplicates, migrations.RunPython.noop),
        migrations.AddConstraint(
            model_name="rollout",
            constraint=models.UniqueConstraint(
                condition=models.Q(("phase__lt", 5)),
                fields=("routing_table",),
                name="one_unfinished_rollout_per_table",
            ),
        ),
    ]
