"""The decoder, its configs, weights, and tokenizer. Knows nothing of sampling, environments or RL."""
