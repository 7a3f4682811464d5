"""Small helpers with no ML in them, shared by checkpoints, conversion and logging."""
