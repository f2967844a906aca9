"""Client array tasks: run agents against servers and report their rewards."""
