"""The thin runtime: the decode step as a static graph per batch bucket."""
