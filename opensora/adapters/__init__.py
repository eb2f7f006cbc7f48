"""Model-family adapters: how to call one family of networks (``ADAPTERS``); methods and the sampler share them.

A new model family is one new module here; importing this package registers every adapter.
"""

from . import mmdit
