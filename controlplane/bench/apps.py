from django.apps import AppConfig


class BenchConfig(AppConfig):
    name = "controlplane.bench"
    label = "bench"
