"""The shared base: what every layer may use (config, errors, hashing, native kernels, modes)."""
