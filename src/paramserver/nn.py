"""`paramserver.nn`: modules whose weights live on the PS."""

from .worker.hash_embedding import HashEmbedding, HashEmbeddingBag

__all__ = ["HashEmbedding", "HashEmbeddingBag"]
