"""Training-step strategies. Importing this package registers every method in ``METHODS``."""

from . import flow_matching  # noqa: F401
