"""Jitted prefill/decode with a KV cache, and the mesh the model and batch are sharded over. Uses model/ only."""
