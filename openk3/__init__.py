"""openk3: an open, readable implementation of the Kimi K3 system."""

from openk3.config import K3Config, get_config

__all__ = ["K3Config", "K3ForCausalLM", "K3Cache", "count_params", "get_config"]
__version__ = "0.1.0"

_FROM_MODEL = ("K3ForCausalLM", "K3Cache", "count_params")


def __getattr__(name: str):
    # NOTE: the model (and with it torch, ~1 s) is imported on first use of one of its names, not by
    # `import openk3`, so that `openk3 --help` and commands that never build a model start at once.
    if name in _FROM_MODEL:
        import openk3.model

        return getattr(openk3.model, name)
    raise AttributeError(f"module 'openk3' has no attribute {name!r}")
