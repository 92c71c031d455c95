"""Kind ``vad``: silero-vad over audio: speech segments, whole files or streamed."""
