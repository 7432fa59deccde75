from django.apps import AppConfig


class ProfilesConfig(AppConfig):
    name = "controlplane.profiles"
    label = "profiles"
