"""`paramserver.nn`: modules whose weights live on the PS."""

from .worker.embedding_collection import HashEmbeddingBagCollection, TableConfig
from .worker.hash_embedding import HashEmbedding
from .worker.hash_embedding_bag import HashEmbeddingBag

__all__ = ["HashEmbedding", "HashEmbeddingBag", "HashEmbeddingBagCollection", "TableConfig"]
