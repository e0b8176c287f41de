"""The wire: the frame codec, the typed messages of every service, gradient codecs and wire dtypes."""
