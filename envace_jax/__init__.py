"""envace-jax: LLM tool-use agents that rehearse the world in their own weights (EnvACE, arXiv 2608.06197)."""

__version__ = "0.1.0"
