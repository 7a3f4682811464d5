"""Studies: precision arms x seeds run side by side, and their report with intervals."""
