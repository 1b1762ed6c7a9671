"""What a run is configured with; below every other package (imports nothing of the project)."""
