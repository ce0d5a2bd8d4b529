"""Domain errors of the service, independent of the transport: the refusals of a call.

Raised by the service core (`service.core`) and by reference resolution and policy (`service.core.references`,
`service.core.policy`). The gRPC layer maps each class to a status code with AIP-193 details in one interceptor
(`service.server.interceptors.ErrorInterceptor`); anything else that escapes a handler becomes INTERNAL, logged
with its traceback and never shown to the caller. How a job that ran ends is not one of these but a
`service.core.JobError` (see `service.core.outcomes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class ServiceError(Exception):
    """Base of the errors a caller is meant to see (message short and actionable)."""


@dataclass(frozen=True)
class FieldViolation:
    field: str  # the request field, in the API's names (e.g. "options.samples")
    description: str


class InvalidArgument(ServiceError):
    """The request is malformed; every violation is listed (BadRequest)."""

    def __init__(self, violations: Sequence[FieldViolation]) -> None:
        assert violations, "an InvalidArgument lists at least one violation"
        self.violations = list(violations)
        super().__init__("; ".join(f"{v.field}: {v.description}" for v in self.violations))


class NotFound(ServiceError):
    """A referenced model, data file, operation or artifact does not exist (ResourceInfo)."""

    def __init__(self, resource_type: str, name: str, description: str = "") -> None:
        self.resource_type, self.name = resource_type, name
        super().__init__(description or f"{resource_type} not found: {name}")


class AlreadyExists(ServiceError):
    """A request_id reused with a different request body."""

    def __init__(self, resource_type: str, name: str, description: str) -> None:
        self.resource_type, self.name = resource_type, name
        super().__init__(description)


class FailedPrecondition(ServiceError):
    """The request is well formed but cannot be done in this state (ErrorInfo reason + metadata)."""

    def __init__(self, reason: str, description: str, metadata: Mapping[str, str] | None = None) -> None:
        self.reason, self.metadata = reason, dict(metadata or {})
        super().__init__(description)


class ResourceExhausted(ServiceError):
    """The job queue is full; retry after `retry_after_s` (RetryInfo)."""

    def __init__(self, description: str, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(description)


class Unavailable(ServiceError):
    """The server is draining for shutdown."""


class PermissionDenied(ServiceError):
    """The reference policy forbids what was asked (a path outside the allowed roots, a disabled scheme)."""

    def __init__(self, reason: str, description: str) -> None:
        self.reason = reason
        super().__init__(description)


class Unauthenticated(ServiceError):
    """No valid bearer token."""

    def __init__(self, reason: str, description: str) -> None:
        self.reason = reason
        super().__init__(description)
