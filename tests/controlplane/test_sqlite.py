"""SQLite chosen by DATABASE_URL=sqlite:///... gets what the embedded default
has: a busy timeout, IMMEDIATE transactions and a write-ahead log. Without
them, two writers at once failed with "database is locked"."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.support import PYTHON, ROOT

NUM_CONCURRENT = 8

# Runs in a child process on the SQLite file: N silences, then N DELETEs
# through the API at once, each on its own thread (its own connection), three
# rounds. A silence's DELETE reads the row, then writes (it expires it, audited):
# the transaction shape that a deferred SQLite transaction cannot upgrade.
CONCURRENT_DELETES = textwrap.dedent(f"""
    import json, threading
    import django
    django.setup()
    from django.conf import settings
    from django.db import connection
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient
    from controlplane.accounts.roles import Role, grant_role
    from django.contrib.auth import get_user_model
    from datetime import timedelta
    from django.utils import timezone
    from controlplane.alerts.models import Silence

    user = get_user_model().objects.create_user("admin")
    grant_role(user, Role.ADMIN)
    token = Token.objects.create(user=user).key
    statuses = []
    for round in range(3):
        now = timezone.now()
        ids = [Silence.objects.create(matchers=[{{"name": "alertname", "value": f"a{{i}}", "isRegex": False,
                                                 "isEqual": True}}], starts_at=now, ends_at=now + timedelta(hours=1),
                                       comment="c", created_by="admin").pk for i in range({NUM_CONCURRENT})]
        barrier = threading.Barrier(len(ids))

        def delete(pk):
            client = APIClient()
            client.credentials(HTTP_AUTHORIZATION="Token " + token)
            barrier.wait()
            try:
                statuses.append(client.delete(f"/api/v1/silences/{{pk}}/").status_code)
            except Exception as exc:
                statuses.append(repr(exc))

        threads = [threading.Thread(target=delete, args=(pk,)) for pk in ids]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode")
        journal = cursor.fetchone()[0]
    print(json.dumps({{"statuses": statuses, "journal_mode": journal,
                      "active": Silence.objects.filter(ends_at__gt=timezone.now()).count()}}))
""")


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CHUNKPILOT_TEST_DB",)}
    env.update(
        DATABASE_URL=f"sqlite:///{tmp_path / 'url.sqlite3'}",
        CHUNKPILOT_DATA_DIR=str(tmp_path),
        DJANGO_SETTINGS_MODULE="controlplane.settings",
        PYTHONUNBUFFERED="1",
    )
    return env


def test_a_sqlite_database_url_gets_the_embedded_defaults_options(tmp_path: Path) -> None:
    code = "import json; from controlplane import settings; print(json.dumps(settings.DATABASES['default']['OPTIONS']))"
    done = subprocess.run(
        [PYTHON, "-c", code], cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    options = json.loads(done.stdout.strip().splitlines()[-1])
    assert options["transaction_mode"] == "IMMEDIATE"
    assert options["timeout"] >= 20
    assert "journal_mode=WAL" in options["init_command"]


@pytest.mark.slow
def test_concurrent_deletes_on_a_sqlite_database_url_all_succeed(tmp_path: Path) -> None:
    env = _env(tmp_path)
    migrate = subprocess.run(
        [PYTHON, "manage.py", "migrate", "--noinput", "-v", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert migrate.returncode == 0, migrate.stderr
    done = subprocess.run(
        [PYTHON, "-c", CONCURRENT_DELETES], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["statuses"] == [200] * (3 * NUM_CONCURRENT)
    assert result["active"] == 0
    assert result["journal_mode"] == "wal"
