"""The knowledge-graph consistency signal: triples from the KB, checked against the response's."""
