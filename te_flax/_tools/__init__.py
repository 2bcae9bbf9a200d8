"""Tools: the optimized-HLO reader and show_config."""
