"""The one error a collective raises when it cannot complete, whatever carried it (gloo,
NCCL, shared memory): a subclass of TimeoutError, since a stuck or dead peer is what ends
every collective early, and callers that already handle timeouts handle it too."""


class CollectiveError(TimeoutError):
    """A collective could not complete: a peer is stuck past the timeout, or gone."""
