"""Alerting: rules on the fleet's figures, Prometheus's alert states,
Alertmanager's routing, notifications and silences, and the rollout kill
switch.

Where things are:

* ``lifecycle``   the state machine of one alert (pure): inactive, pending,
                  firing, resolved, no data; ``for``, ``keep_firing_for``,
                  flapping.
* ``labels``      fingerprints and matchers (pure), as Prometheus has them.
* ``routing``     routes, groups, Alertmanager's dedup decision and the v4
                  webhook payload (pure).
* ``models``      rules, alerts and their transitions, receivers, routes,
                  notification groups, deliveries, silences, inbound alerts.
* ``sources``     what a rule's figure is worth now, per group, reading each
                  stored window once per cycle (``metrics.reader``).
* ``evaluation``  one cycle: due rules, state steps, writes (idempotent).
* ``notify``      ``notify_event`` for other apps, the dispatcher, delivery.
* ``receivers/``  channels (webhook, email, external Alertmanager).
* ``killswitch``  firing ``abort_rollout`` alerts and inbound webhooks → the
                  rollout's abort flag.
* ``tasks``       Celery: evaluate (every ALERT_EVAL_INTERVAL), dispatch,
                  deliver, purge.
"""
