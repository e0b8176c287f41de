"""The worker side in PyTorch: cluster context, PS-backed optimizers, and the Trainer."""
