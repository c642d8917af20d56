"""The Python SDK for rlgate's users: RL jobs and sessions on a running gateway
(``client``), and task apps, the synth-ai contract with a helper to write one
(``taskapp``). Its public names are importable from here::

    from rlgate.sdk import Client, RLJob, Session, create_task_app, serve
"""

from rlgate.sdk.client import (
    APIConnectionError,
    APIStatusError,
    AsyncClient,
    AsyncRLJob,
    AsyncSession,
    AuthenticationError,
    BadRequestError,
    Client,
    ConflictError,
    GoneError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RLGateError,
    RLJob,
    Session,
    UnprocessableEntityError,
    list_jobs,
)
from rlgate.sdk.taskapp import (
    EnvSpec,
    Episode,
    Outcome,
    PolicySpec,
    RolloutMetrics,
    RolloutRequest,
    RolloutResponse,
    TaskInfo,
    create_task_app,
    serve,
)

__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "AsyncClient",
    "AsyncRLJob",
    "AsyncSession",
    "AuthenticationError",
    "BadRequestError",
    "Client",
    "ConflictError",
    "EnvSpec",
    "Episode",
    "GoneError",
    "InternalServerError",
    "NotFoundError",
    "Outcome",
    "PermissionDeniedError",
    "PolicySpec",
    "RLGateError",
    "RLJob",
    "RateLimitError",
    "RolloutMetrics",
    "RolloutRequest",
    "RolloutResponse",
    "Session",
    "TaskInfo",
    "UnprocessableEntityError",
    "create_task_app",
    "list_jobs",
    "serve",
]
