"""Websocket routes, one Channels consumer per live view."""

from django.urls import URLPattern

websocket_urlpatterns: list[URLPattern] = []
