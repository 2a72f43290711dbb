"""Knowledge base, BM25 and dense retrieval, reranking."""
