"""Training-step strategies. Importing this package registers every method in ``METHODS`` and every model-family
adapter in ``ADAPTERS``."""

from . import adapters  # noqa: F401
from . import dmd2  # noqa: F401
from . import flow_matching  # noqa: F401
from . import causal_init  # noqa: F401
from . import causvid  # noqa: F401
from . import self_forcing  # noqa: F401
