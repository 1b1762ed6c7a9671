"""Benchmark adapters over the real harnesses (tau2, bfcl, checklist, ...), speaking `base.ToolEnv`/`Task`."""
