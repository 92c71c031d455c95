"""Kind ``ensemble``: a Triton ensemble (``platform: "ensemble"``) served as its steps, each a
served model called through the model contract, tensors mapped between them by name."""
