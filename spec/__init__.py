"""Speculation: the drafters (`DRAFTERS`, spec/drafters.py), the token table and index they read,
the budget that decides a step's draft rows, and the Speculator the engine talks to."""

from spec.drafters import DRAFTERS  # noqa: F401
