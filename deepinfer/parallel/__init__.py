"""Several devices: expert placement (`eplb`)."""
