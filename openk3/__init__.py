"""openk3: an open, readable implementation of the Kimi K3 system."""

from openk3.config import K3Config, get_config
from openk3.model import K3Cache, K3ForCausalLM, count_params

__all__ = ["K3Config", "K3ForCausalLM", "K3Cache", "count_params", "get_config"]
__version__ = "0.1.0"
