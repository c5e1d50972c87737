"""The one error weight sync raises: a message for the user and the HTTP status that fits it."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """A weight update that did not happen; the old weights still serve.

    `status` is what an HTTP route should answer: 400 for a request that can never succeed
    as sent (bad metadata, unknown names, wrong shapes), 404 for an unknown group, 409 for a
    version that is not above the current one, 504 for a trainer that stopped sending,
    500 for anything else.

    `failed`: from `WeightPusher.push`, the engine URLs that did not take the update (the others
    did); a pusher made for just those retries them alone.
    """

    def __init__(self, message: str, status: int = 400, failed: list[str] | None = None):
        super().__init__(message)
        self.status = status
        self.failed = failed or []
