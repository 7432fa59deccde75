"""The workers' benchmarks, kept out of the product packages.

Each ``python -m workers`` benchmark command is a module here: ``prefill``
(``bench``: what chunked prefill does, in-process), ``serve``
(``bench-serve``: what HTTP costs, and vLLM against ours) and ``gpu_check``
(``gpu-check``: the reference engine on a real GPU). They share one replay
harness, ``harness``: a workload's requests fed to an engine behind one small
adapter interface, timed where its steps return. Nothing in ``workers/``
outside this package imports it.
"""
