"""Before expert compute, integers only: pair counts (and budgets) in, a frozen call plan out."""
