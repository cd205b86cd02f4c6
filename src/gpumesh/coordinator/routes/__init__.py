"""The coordinator's HTTP routes, one module per resource.

    meta     GET /v1/health, /v1/openapi.json, /v1/dist/{name}; unmatched requests
    workers  /v1/workers[...]: register, heartbeat, session, leave, lease
    tasks    /v1/tasks/{id}/result|output|release: what a worker posts about a task
    batch    /v1/tasks/results: several results at once, a slot's queue of grants
    blobs    /v1/blobs/{sha256}, /v1/handoff: payload storage
    jobs     /v1/jobs[...]: submit, list, status, results, logs, release, cancel, retry
    tokens   /v1/tokens[...]: the people's tokens (admin)

:mod:`.base` holds what they share (registration, the auth gate, the app's state).
Importing this package registers every route in :data:`.base.ENDPOINTS`, in this order.
"""

from . import meta, workers, tasks, batch, blobs, jobs, tokens  # noqa: F401  (registers the routes)
from .base import ENDPOINTS, Context, endpoint

__all__ = ["ENDPOINTS", "Context", "endpoint"]
