"""Settings for the Chunkpilot control plane, all from the environment.

With nothing set this is the embedded default: SQLite and an embedded Redis
under ``var/``. ``DATABASE_URL`` and ``REDIS_URL`` switch to PostgreSQL and an
external Redis. These are the deployment's variables, which Django needs
before any app loads; each app's tunables live in its own ``conf.py``
(``controlplane.conf``). README.md lists both.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent


def env_str(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return default if value in (None, "") else float(value)


def env_list(name: str, default: list[str]) -> list[str]:
    value = os.environ.get(name)
    if not value:
        return default
    return [item.strip() for item in value.split(",") if item.strip()]


DATA_DIR = Path(env_str("CHUNKPILOT_DATA_DIR", str(BASE_DIR / "var")))
DATA_DIR.mkdir(parents=True, exist_ok=True)


def _secret_key() -> str:
    if key := env_str("SECRET_KEY"):
        return key
    # The embedded default keeps one generated key so sessions survive restarts.
    key_file = DATA_DIR / "secret_key"
    if not key_file.exists():
        key_file.write_text(secrets.token_urlsafe(50))
        key_file.chmod(0o600)
    return key_file.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])
# Absolute URL of the web UI, for links in notifications.
EXTERNAL_URL = env_str("EXTERNAL_URL", "http://127.0.0.1:8000")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "django_htmx",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's files, served from here (no CDN)
    # domain apps, one per domain (docs/architecture.md, "Apps")
    "controlplane.accounts",
    "controlplane.audit",
    "controlplane.fleet",
    "controlplane.profiles",
    "controlplane.gateway",
    "controlplane.metrics",
    "controlplane.rollouts",
    "controlplane.experiments",
    "controlplane.alerts",
    "controlplane.advisor",
    # the benchmarks' commands (above every app, outside the product)
    "controlplane.bench",
    # web UI
    "dashboards",
]

MIDDLEWARE = [
    # A store outage becomes a 503, never a 500 (controlplane/outages.py).
    "controlplane.outages.StoreOutageMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "controlplane.accounts.errors.RefuseBadQuery",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "dashboards.access.role_context",
                "dashboards.alerts.pages.critical_alerts",
            ],
        },
    },
]

# --- database -------------------------------------------------------------
# SQLite, however chosen (the embedded default or DATABASE_URL=sqlite:///...):
# several processes share the file, so wait for locks, take the write lock
# when a transaction starts (a deferred one that reads, then writes, fails
# at once with "database is locked" when another writer got there first) and
# keep a write-ahead log so readers never block the writer.
SQLITE_OPTIONS = {
    "timeout": 20,
    "transaction_mode": "IMMEDIATE",
    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
}
DATABASE_URL = env_str("DATABASE_URL")
if DATABASE_URL:
    # No persistent connections by default: under ASGI every request runs in
    # a fresh thread, and a thread's kept-open connection outlives it (the web
    # server ran PostgreSQL out of connections in the heartbeat benchmark).
    # Long-running processes can pool instead (DATABASE_POOL_MAX_SIZE).
    DATABASES = {
        "default": dj_database_url.parse(
            DATABASE_URL, conn_max_age=env_int("DATABASE_CONN_MAX_AGE", 0), conn_health_checks=True
        )
    }
    if (pool_max_size := env_int("DATABASE_POOL_MAX_SIZE", 0)) and DATABASES["default"]["ENGINE"].endswith(
        "postgresql"
    ):
        DATABASES["default"]["CONN_MAX_AGE"] = 0  # Django requires it with a pool
        DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
            "min_size": 1,
            "max_size": pool_max_size,
            "timeout": env_float("DATABASE_POOL_TIMEOUT_SECONDS", 10.0),
        }
else:
    DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(DATA_DIR / "chunkpilot.sqlite3")}}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # Options the URL names (?timeout=5) win over these.
    DATABASES["default"]["OPTIONS"] = {**SQLITE_OPTIONS, **DATABASES["default"].get("OPTIONS", {})}
# Lets concurrent test runs on one PostgreSQL keep apart (CHUNKPILOT_TEST_DB=test_x).
if test_db_name := env_str("CHUNKPILOT_TEST_DB"):
    DATABASES["default"]["TEST"] = {"NAME": test_db_name}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- redis: broker, channel layer, routing epochs -------------------------
REDIS_URL = env_str("REDIS_URL")
EMBEDDED_REDIS = not REDIS_URL
if EMBEDDED_REDIS:
    from controlplane import embedded

    _urls = embedded.urls(DATA_DIR)
    REDIS_URL = _urls["redis"]
    CELERY_BROKER_URL = _urls["kombu"]
else:
    CELERY_BROKER_URL = REDIS_URL

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        # redis-py 8 defaults socket_timeout to 5 s, which aborts the layer's
        # blocking BZPOPMIN (itself 5 s) and tears every websocket down
        # (django/channels_redis#422): give reads a longer timeout.
        "CONFIG": {
            "hosts": [{"address": REDIS_URL, "socket_timeout": 15}],
            "prefix": env_str("CHANNELS_PREFIX", "chunkpilot"),
        },
    }
}

# --- celery ---------------------------------------------------------------
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True  # a worker killed mid-task leaves the task queued
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": env_int("CELERY_VISIBILITY_TIMEOUT", 300)}
CELERY_TASK_DEFAULT_QUEUE = env_str("CELERY_QUEUE", "chunkpilot")
CELERY_TIMEZONE = "UTC"

# --- auth and API ---------------------------------------------------------
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "login"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        # Token first so that an anonymous call answers 401 with WWW-Authenticate.
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["controlplane.accounts.permissions.RolePermission"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "controlplane.accounts.inputs.Pagination",
    "PAGE_SIZE": 100,
    "EXCEPTION_HANDLER": "controlplane.accounts.errors.exception_handler",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Chunkpilot admin API",
    "DESCRIPTION": "Fleet, engine profiles, routing, metrics, rollouts and alerts.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # Row ids in paths (controlplane.accounts.inputs.IdConverter): digits a bigint holds.
    "PATH_CONVERTER_OVERRIDES": {"id": {"type": "integer", "minimum": 1, "maximum": 10**18 - 1}},
    # /api/docs/ works offline: Swagger UI from drf-spectacular-sidecar's static files.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # Every operation's error replies (400, 401, 403, 404, 409, 503) in the document.
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "controlplane.accounts.schema.document_errors",
    ],
}

# --- static files, time, logging ------------------------------------------
STATIC_URL = "static/"
STATIC_ROOT = DATA_DIR / "staticfiles"
STATIC_ROOT.mkdir(exist_ok=True)  # WhiteNoise warns at start when it is missing
STATICFILES_DIRS = [("vendor", BASE_DIR / "node_modules")] if (BASE_DIR / "node_modules").exists() else []
WHITENOISE_USE_FINDERS = True  # serve straight from the finders: no collectstatic step

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}
