"""Who am I: the caller's name and role, for scripts and the UI."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.accounts.roles import role_of


class MeView(APIView):
    @extend_schema(
        responses=inline_serializer("Me", {"username": serializers.CharField(), "role": serializers.CharField()})
    )
    def get(self, request: Request) -> Response:
        return Response({"username": request.user.get_username(), "role": role_of(request.user).group_name})
