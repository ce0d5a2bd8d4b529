"""A request's own fields, checked alike by the client before it sends anything (`service.client.options`) and
by the server's submission (`service.core.submission`): the request id and the labels."""

from __future__ import annotations

import re
import uuid

from .errors import FieldViolation, InvalidArgument

LABEL_KEY = re.compile(r"^[a-z][a-z0-9_-]{0,62}\Z")  # \Z: `$` also matches before a final newline
MAX_LABELS = 64


def check_request_id(request_id: str) -> None:
    try:
        uuid.UUID(request_id)
    except ValueError:
        raise InvalidArgument([FieldViolation("request_id", "must be a UUID (AIP-155), e.g. from uuid.uuid4()")]
                              ) from None


def label_violations(labels: dict[str, str]) -> list[FieldViolation]:
    # values are printed by `osscar operations` on other users' terminals: no control characters (escapes)
    violations = [FieldViolation(f"labels[{key}]", "label keys are lowercase letters, digits, _ and - (start with "
                                                     "a letter, <= 63), values <= 63 printable characters")
                  for key, value in labels.items()
                  if not LABEL_KEY.match(key) or len(value) > 63 or not value.isprintable()]
    if len(labels) > MAX_LABELS:
        violations.append(FieldViolation("labels", f"at most {MAX_LABELS} labels"))
    return violations
