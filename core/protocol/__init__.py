"""Protocol surfaces: each translates wire messages to and from the data plane."""
