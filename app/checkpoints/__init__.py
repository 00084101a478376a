"""Checkpoints: the manager (the library API), chunk files, resume, publishing, output locations.

`from app.checkpoints import CheckpointManager, RequestCache` is the drop-in for datatrove's classes.
"""

from app.checkpoints.manager import CheckpointManager, RequestCache

__all__ = ["CheckpointManager", "RequestCache"]
