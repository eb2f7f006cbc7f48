"""Record a model's constructor arguments once, as diffusers' ``register_to_config`` does."""

import functools
import inspect


def records_arch(init):
    """Decorate a model's ``__init__`` so that ``self.arch`` holds every constructor argument, defaults filled in.

    ``type(model)(**model.arch)`` rebuilds the model and the FLOP counter reads its shape from it. ``arch`` exists
    before the body runs, so the body may resolve entries (an ``out_channels=None`` default) and setters may keep
    it current. Lists are stored as tuples: an arch read back from a config text compares equal to the model's.
    """
    signature = inspect.signature(init)

    @functools.wraps(init)
    def recording_init(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = {name: value for name, value in bound.arguments.items() if name != "self"}
        self.__dict__["arch"] = {name: tuple(v) if isinstance(v, list) else v for name, v in arguments.items()}
        init(self, *args, **kwargs)

    return recording_init
