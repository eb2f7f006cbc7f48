"""Networks: importing this package registers every model configs can name (see opensora.registry)."""

from . import mmdit, text, vae  # noqa: F401  (imported for their MODELS registrations)
