"""Training-step strategies. Importing this package registers every method in ``METHODS``."""

from . import causal_init, causvid, dmd2, flow_matching, long_rollout, self_forcing
