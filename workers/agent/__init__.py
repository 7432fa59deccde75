"""The worker agent: registration, heartbeats and profile switches against
the control plane (the JSON of ``workers.contract``), over HTTP only."""

from workers.agent.agent import Agent
from workers.agent.client import ControlPlaneClient, ControlPlaneError, Unauthorized, Unreachable
from workers.agent.hardware import detect_hardware

__all__ = ["Agent", "ControlPlaneClient", "ControlPlaneError", "Unauthorized", "Unreachable", "detect_hardware"]
