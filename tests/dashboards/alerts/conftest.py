# The alerts suite's own fixture (the shipped rules, switched off), shared
# with the alert pages' tests rather than written twice.
from tests.controlplane.alerts.conftest import shipped_rules  # noqa: F401
