"""Ground truth for the advisor: a panel of seeded traffic scenarios, each
run monolithic and chunked on the same workers, whose client-side outcome
says whether chunking paid; the advisor's verdict on the live figures of one
run is compared with it. ``python manage.py validate_decisions`` runs it
(docs/validation.md).

* ``outcome``: a run's outcome and the rule "chunking pays" (pure);
* ``scenarios``: the panel (pure);
* ``harness``: worker sets, runs, the control plane's view of a run, the rows;
* ``experiment``: the experiments' recommendation on a sweep of arms against
  a rerun of the recommended arm.
"""
