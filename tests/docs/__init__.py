"""README, docs pages, the support matrix, import layering and private torch API checks."""
