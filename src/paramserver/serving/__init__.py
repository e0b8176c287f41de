"""`paramserver.serving`: run a trained model with no cluster.

    model = MyModel()                                    # the class that was trained
    paramserver.serving.load(model, "model.safetensors") # `paramserver checkpoint export`'s file, or a checkpoint dir
    model.eval()
    scores = model(dense, ids)                           # embedding rows looked up in the model itself
    program = torch.export.export(model, (dense, ids))   # for a serving stack
    paramserver.serving.apply_delta(model, "delta.safetensors")  # `export --since CKPT`: the later checkpoint
    paramserver.serving.served(model)                    # the checkpoint it serves: name, manifest SHA-256, run id

See docs/embeddings.md, "Serving what was trained".
"""

from paramserver.serving.loading import apply_delta, load, served

__all__ = ["apply_delta", "load", "served"]
