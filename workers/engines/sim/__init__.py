"""Chunkpilot's simulated engine: a GPU fleet's dynamics on any machine.

The reference engine's scheduler, block manager and sequences (so every
profile knob means what it means there), with each step's duration taken
from NVIDIA AIConfigurator's measured kernel database for a GPU, backend and
model (``steptime.AicDevice``), or from a table fitted to the reference
engine on this CPU (``steptime.FittedDevice``). Tokens come from a seeded
generator over a real tokenizer's vocabulary. A simulated worker reports
engine kind ``sim`` and hardware "<GPU> (simulated)" everywhere.

``engine.SimAsyncLLM`` serves in real time behind the OpenAI server;
``virtual.replay`` runs a workload in virtual time for predictions.
docs/engines.md says what is simulated and how it was validated.
"""
