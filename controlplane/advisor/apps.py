from django.apps import AppConfig


class AdvisorConfig(AppConfig):
    name = "controlplane.advisor"
    label = "advisor"
