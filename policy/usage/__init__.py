"""Usage and spend: prices per model, the usage rollup from the audit trail, budget alerts.

``cost`` holds the exact money arithmetic (integer micro-dollars), ``rollup``
turns indexed audit events into additive increments of the ``usage_rollup``
table (inside the audit indexer's transaction), ``store`` reads usage and
manages prices and budget alerts. docs/usage.md says why usage is rolled up
from the audit trail. Import the modules themselves: the limiter needs only
``cost``, without the store.
"""
