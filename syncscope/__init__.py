"""syncscope: make the coordination costs of synchronous distributed PyTorch training visible and bounded."""

__version__ = "0.1.0"
__all__ = ["__version__"]
