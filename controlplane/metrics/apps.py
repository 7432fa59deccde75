from django.apps import AppConfig


class MetricsConfig(AppConfig):
    name = "controlplane.metrics"
    label = "metrics"
