from django.apps import AppConfig


class RolloutsConfig(AppConfig):
    name = "controlplane.rollouts"
    label = "rollouts"

    def ready(self) -> None:
        from controlplane.rollouts import gauges  # noqa: F401 - registers the control plane's rollout gauges
