"""The worker's OpenAI-compatible server: the HTTP app (``app``), request and
response JSON (``protocol``), the engine host that admits requests and switches
profiles (``host``), the Prometheus exporter (``metrics``) and the ``serve``
command (``cli``). The engines it serves from are ``workers.engines``."""
