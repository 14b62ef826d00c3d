"""Shared pytest configuration.

Hypothesis profiles: ``dev`` (default), ``ci`` (derandomized; the default when
the ``CI`` environment variable is set) and ``nightly`` (many more examples).
Choose one with ``HYPOTHESIS_PROFILE=nightly pytest ...``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "nightly",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))
