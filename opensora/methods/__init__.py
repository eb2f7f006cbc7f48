"""Training-step strategies. Importing this package registers every method in ``METHODS``."""

from . import dmd2  # noqa: F401
from . import flow_matching  # noqa: F401
