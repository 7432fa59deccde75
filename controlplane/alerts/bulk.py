"""Writing many changed rows at once.

Django's ``bulk_update`` builds one ``CASE WHEN id = … THEN …`` per field and
row, which costs seconds of Python for a few thousand alerts. On PostgreSQL
this sends each column as one array and updates from ``unnest`` of them:
one statement with one parameter per column, whatever the number of rows.
Elsewhere it falls back to ``bulk_update``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, cast

from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection
from django.db.models import Field, JSONField, Model


def update_rows(rows: Sequence[Model], fields: Sequence[str]) -> int:
    if not rows:
        return 0
    model = type(rows[0])
    if connection.vendor != "postgresql":
        return model._default_manager.bulk_update(rows, fields, batch_size=500)
    meta = model._meta
    columns: list[Field[Any, Any]] = [cast(Field, meta.pk)] + [cast(Field, meta.get_field(name)) for name in fields]
    quote = connection.ops.quote_name
    arrays, selects, casts = [], [], []
    for field in columns:
        values = [getattr(row, field.attname) for row in rows]
        if isinstance(field, JSONField):
            # As text, cast back on the server: one array instead of a value per row.
            arrays.append([json.dumps(v, cls=DjangoJSONEncoder) for v in values])
            selects.append("%s::text[]")
            casts.append("::jsonb")
        else:
            arrays.append(values)
            selects.append(f"%s::{field.db_type(connection)}[]")
            casts.append("")
    names = [quote(str(f.column)) for f in columns]
    sets = ", ".join(f"{name} = v.{name}{cast}" for name, cast in zip(names[1:], casts[1:], strict=True))
    sql = (
        f"UPDATE {quote(meta.db_table)} AS t SET {sets} "
        f"FROM unnest({', '.join(selects)}) AS v({', '.join(names)}) WHERE t.{names[0]} = v.{names[0]}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, arrays)
        return int(cursor.rowcount)
