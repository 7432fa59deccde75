from django.apps import AppConfig


class RolloutsConfig(AppConfig):
    name = "controlplane.rollouts"
    label = "rollouts"

    def ready(self) -> None:
        # Imported here: the hooks need the models, which load after the app configs.
        from controlplane.rollouts import hooks

        hooks.register()
