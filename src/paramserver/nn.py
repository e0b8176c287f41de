"""`paramserver.nn`: modules whose weights live on the PS."""

from .worker.hash_embedding import HashEmbedding
from .worker.hash_embedding_bag import HashEmbeddingBag

__all__ = ["HashEmbedding", "HashEmbeddingBag"]
