"""LRM scores of token-expert pairs and the ``sample`` / ``topk`` selection of survivors."""
