"""titanext: plugins that extend PyTorch's native distributed stack."""

__version__ = "0.1.0"
