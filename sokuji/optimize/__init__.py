"""``sokuji optimize``: build model variants, measure them on the same ground, gate them on
quality, and record the result next to the model for the server to use."""
