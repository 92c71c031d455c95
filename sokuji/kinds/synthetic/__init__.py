"""Kind ``synthetic``: an encoder with a known service-time distribution, errors on purpose
and a bad phase (tests, drills, capacity planning)."""
