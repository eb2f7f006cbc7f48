"""Training-step strategies. Importing this package registers every method in ``METHODS``."""

from . import dmd2, flow_matching
