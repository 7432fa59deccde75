"""Everything that runs on a GPU host: the reference engine, the vLLM backend,
the worker server and agent, the load generator. Never imports Django."""
