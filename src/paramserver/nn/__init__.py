"""`paramserver.nn`: modules whose weights live on the PS."""

from paramserver.nn.embedding_collection import HashEmbeddingBagCollection, TableConfig
from paramserver.nn.hash_embedding import HashEmbedding
from paramserver.nn.hash_embedding_bag import HashEmbeddingBag

__all__ = ["HashEmbedding", "HashEmbeddingBag", "HashEmbeddingBagCollection", "TableConfig"]
