"""What an operator allows for the tests' upstreams on loopback: an allow list that names loopback.

Without one the egress rules (``backends/openai/egress.py``) refuse a loopback
endpoint like any private one, so every test whose upstream listens on
127.0.0.1 says so, as a deployment's ``upstreams.allowed_hosts`` would.
"""

from __future__ import annotations

from inferflux.backends.openai.egress import EgressPolicy

LOOPBACK_HOSTS = ["127.0.0.1", "::1", "localhost"]
LOOPBACK = EgressPolicy(allowed_hosts=tuple(LOOPBACK_HOSTS))  # FleetConfig(egress=...), load_served_model(egress=...)
LOOPBACK_UPSTREAMS = {"allowed_hosts": LOOPBACK_HOSTS}  # the settings' upstreams section
