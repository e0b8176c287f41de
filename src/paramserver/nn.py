"""`paramserver.nn`: modules whose weights live on the PS."""

from .worker.embedding import HashEmbedding, HashEmbeddingBag

__all__ = ["HashEmbedding", "HashEmbeddingBag"]
