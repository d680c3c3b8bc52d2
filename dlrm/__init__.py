"""DLRM training on Criteo click logs."""

__version__ = "0.1.0"
