"""The compression job that `osscar compress` and the service's workers run.

`request` (the options schema and its validation), `kinds` (what differs between conv graphs, text and
vision transformers, behind the `ModelJob` protocol), `targeting` (loss curves, the closed
prune -> measure loop, the choice of round), `report` / `report_html` (report.json and report.html) and
`compress` (the orchestration).
"""

from .compress import compress
from .request import CompressRequest

__all__ = ["CompressRequest", "compress"]
