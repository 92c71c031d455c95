"""Kind ``classifier``: labels by nearest centroid (or prototype) over a text encoder."""
