"""The control plane's benchmarks: a top-layer app of their own, apart from
the product's apps.

The ``manage.py bench_*`` commands (``management/commands/``) make throwaway
``bench-*`` rows, drive the real processes and print figures; the modules
beside them are what the commands share: ``gateway.py`` (the gateway's added
TTFT beside nginx), ``synthetic.py`` (a worker that streams made-up tokens on
a fixed clock), ``upstream.py`` (the gateway's upstream interface over httpx,
the comparison that chose the gateway's own client). Being above every app,
they may use any of them and any module of ``workers/``; no product module
imports them.
"""
